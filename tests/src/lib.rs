//! End-to-end and cross-component tests live in `tests/tests/`.
