//! `flotilla checkpoint PATH`: what a checkpoint holds (its step and place in the data, model,
//! ZeRO shards or pipeline stages, optimizer state, tensors, files), and with `--export FILE`
//! the whole of it as one safetensors file PyTorch loads
//! ([`flotilla_train::checkpoint_export`]).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use flotilla_train::checkpoint_export;

/// `flotilla checkpoint`.
#[derive(Debug, Clone, Args)]
pub struct CheckpointArgs {
    /// A checkpoint's directory, or a run's output directory (its newest complete checkpoint).
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
    /// Also write the whole checkpoint as one safetensors file: the model's tensors under
    /// their PyTorch names, a spec model's optimizer state laid out as the weights
    /// (`optimizer.<tensor>.<field>`, ZeRO shards put together), the step and place in the
    /// data in its metadata.
    #[arg(long, value_name = "FILE")]
    pub export: Option<PathBuf>,
}

/// Runs `flotilla checkpoint`.
pub fn run(args: &CheckpointArgs) -> Result<()> {
    let contents = checkpoint_export::contents(&args.path).context("reading the checkpoint")?;
    print!("{contents}");
    let Some(out) = &args.export else {
        return Ok(());
    };
    let done = checkpoint_export::export(&args.path, out)
        .with_context(|| format!("exporting it to {}", out.display()))?;
    let (model, optimizer) = done.tensors;
    println!(
        "wrote {}: {model} model tensors, {optimizer} optimizer tensors",
        out.display()
    );
    if let Some(why) = done.without_optimizer {
        println!("without the optimizer state: {why}");
    }
    Ok(())
}
