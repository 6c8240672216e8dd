//! `ds4-server`: OpenAI / Anthropic / Responses compatible HTTP server.

fn main() {
    eprintln!("ds4-server: not built yet");
    std::process::exit(2);
}
