//! Exits non-zero, listing them, when test beds left anything behind:
//! directories, mounts, processes or bridges. The test command runs it last.

fn main() {
    let found = sandbolt_testbed::leftovers();
    if found.is_empty() {
        println!("test bed leftovers: none");
        return;
    }
    eprintln!("test beds left {} thing(s) behind:", found.len());
    for f in &found {
        eprintln!("  {f}");
    }
    std::process::exit(1);
}
