//! `ds4-bench`: throughput, kernel bandwidth, KV restore and cross-backend correctness.

fn main() {
    eprintln!("ds4-bench: not built yet");
    std::process::exit(2);
}
