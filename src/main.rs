//! The `colotrain` binary: parses the command line and runs one subcommand (see `colotrain::cli`).

fn main() {
    std::process::exit(colotrain::cli::main());
}
