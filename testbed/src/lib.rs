//! sandbolt testbed (not built yet).
