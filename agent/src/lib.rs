//! sandbolt agent (not built yet).
