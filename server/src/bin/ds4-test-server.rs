//! `ds4-test-server`: `ds4-server` built with the `test-model` feature, which adds the scripted test model's flags
//! (`--fake-model`, `--fake-script`, `--fake-delay-ms`) for the client and agent tests. Never a production binary.

#[path = "../main.rs"]
mod server_main;

fn main() -> anyhow::Result<()> {
    server_main::main()
}
