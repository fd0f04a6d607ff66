//! The `colotrain` binary: parses the command line and runs one subcommand (see `colotrain::cli`).

#[global_allocator]
static ALLOC: colotrain::util::TrackingAlloc = colotrain::util::TrackingAlloc;

fn main() {
    std::process::exit(colotrain::cli::main());
}
