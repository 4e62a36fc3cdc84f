//! `flotilla secret`: a fresh random cluster secret (32 bytes of the system's generator, as
//! 64 hexadecimal characters), printed, or written to a new file of mode 0600 that every rank
//! of a job reads (`FLOTILLA_SECRET_FILE`, `comm.secret_file`). `flotilla launch` makes one
//! for every job by itself; this is for ranks started another way (by hand, torchrun's
//! variables, Slurm, Kubernetes, a library world).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use flotilla_tcp::{SECRET_FILE_ENV, Secret};

/// `flotilla secret`.
#[derive(Debug, Clone, Args)]
pub struct SecretArgs {
    /// Write the secret to this new file (mode 0600; an existing file is never overwritten)
    /// instead of printing it.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// Runs `flotilla secret`.
pub fn run(args: &SecretArgs) -> Result<()> {
    let secret = Secret::generate();
    match &args.out {
        None => {
            let text = String::from_utf8_lossy(secret.bytes());
            println!("{text}");
        }
        Some(path) => {
            secret
                .write_private(path)
                .with_context(|| format!("writing the secret to {}", path.display()))?;
            eprintln!(
                "wrote a new cluster secret to {} (mode 0600); give every rank \
                 {SECRET_FILE_ENV}={}",
                path.display(),
                path.display()
            );
        }
    }
    Ok(())
}
