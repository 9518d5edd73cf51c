//! sandbolt controller (not built yet).
