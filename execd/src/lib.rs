//! sandbolt execd (not built yet).
