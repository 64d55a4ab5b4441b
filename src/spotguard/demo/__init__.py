"""The embedded-default demonstration: a sample job and the end-to-end scenario."""
