fn main() {
    std::process::exit(umbp_cli::main_with_args(std::env::args_os()));
}
