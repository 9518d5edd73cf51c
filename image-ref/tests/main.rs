//! All of this crate's integration tests, one module per file, built as one
//! test binary (as in every crate of the workspace).

mod prop_image_ref;
