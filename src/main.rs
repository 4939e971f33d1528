//! The `zerolayer` command: serve a model over HTTP and QUIC, chat with it in the terminal,
//! generate, tokenize, measure perplexity, fetch the default model, benchmark.
//!
//! ```text
//! zerolayer pull                      # the default model into the cache
//! zerolayer serve                     # http://127.0.0.1:8080/ (chat page) and the APIs
//! zerolayer run                       # chat in the terminal
//! zerolayer --help
//! ```

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
