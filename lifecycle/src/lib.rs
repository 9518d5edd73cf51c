//! sandbolt lifecycle (not built yet).
