// Placeholder so the workspace manifest parses; the owner replaces it.
fn main() {}
