fn main() -> std::process::ExitCode {
    sandbolt::main()
}
