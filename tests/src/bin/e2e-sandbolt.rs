//! `sandbolt` itself, built as this crate's binary so that its tests can
//! start it as a child (`CARGO_BIN_EXE_e2e-sandbolt`): Cargo builds a
//! package's binaries for that package's tests only.

fn main() -> std::process::ExitCode {
    sandbolt::main()
}
