"""Kept only for server modules being rewritten (worker_stages, backend, http_images): they import
TeaCache's construction and head-side check from here; both live in ``triptych.pipelines.teacache``.
Delete this file once they import from there."""

from triptych.pipelines.teacache import check_teacache, make_teacache

__all__ = ["check_teacache", "make_teacache"]
