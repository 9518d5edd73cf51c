//! sandbolt benches (not built yet).
