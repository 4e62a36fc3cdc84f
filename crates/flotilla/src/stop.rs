//! `flotilla stop --inventory hosts.ini`: ends, on every host of the inventory, the ranks that
//! `flotilla launch --inventory` started there (all jobs under `--remote-dir`, or `--job ID`),
//! each by the pid it recorded — never by process name.

use anyhow::{Result, bail};
use flotilla_cluster::{Inventory, SshTarget};

use crate::cli::StopArgs;
use crate::launch::remote;

/// Runs `flotilla stop`.
pub fn run(args: &StopArgs) -> Result<()> {
    let inventory = Inventory::load(&args.inventory)?;
    if inventory.is_empty() {
        bail!("{} lists no hosts", args.inventory.display());
    }
    let targets = inventory
        .hosts()
        .iter()
        .map(SshTarget::from_host)
        .collect::<Result<Vec<_>, _>>()?;
    let mut seen = std::collections::HashSet::new();
    let distinct: Vec<&SshTarget> = targets
        .iter()
        .filter(|t| seen.insert(t.login_key()))
        .collect();
    let pattern = remote::job_pattern(&args.remote_dir, args.job.as_deref())?;
    let (lines, failures) = remote::stop_on_hosts(&distinct, &pattern);
    let stopped = lines.iter().filter(|l| l.contains(": stopped ")).count();
    for line in &lines {
        println!("{line}");
    }
    println!(
        "stopped {stopped} rank(s) on {} host(s) of {}",
        distinct.len() - failures.len(),
        args.inventory.display()
    );
    if !failures.is_empty() {
        bail!(
            "{} host(s) could not be reached:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}
