//! The `powerinfer` command. All logic lives in the `powerinfer_cli` library.

use clap::Parser;

fn main() {
    let cli = powerinfer_cli::Cli::parse();
    if let Err(e) = powerinfer_cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
