"""Seeded tiny models built from configs, for tests and offline defaults (``triptych make-tiny``)."""
