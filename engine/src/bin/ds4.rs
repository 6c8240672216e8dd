//! The `ds4` command-line tool; see [`ds4_engine::cli`].

fn main() {
    std::process::exit(ds4_engine::cli::main());
}
