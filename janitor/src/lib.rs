//! sandbolt janitor (not built yet).
