"""The HTTP head: the OpenAI-compatible app, its routes, admission, jobs and the served-model table."""
