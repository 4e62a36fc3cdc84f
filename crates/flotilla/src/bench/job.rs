//! One benchmark job: `flotilla launch` of a generated config, run to completion within a
//! limit, and every rank's figures read from the launcher's `summary.json`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// One rank's figures (`summary.json`'s `ranks[r].figures`).
pub type Figures = BTreeMap<String, f64>;

/// Runs `flotilla launch` on `yaml` (written to `dir/<name>.yaml`, output in `dir/<name>`)
/// and returns each rank's figures, rank 0 first. Past `limit` the job is killed and this is
/// an error; so is a failed job (with its stderr).
pub fn run(dir: &Path, name: &str, yaml: &str, limit: Duration) -> Result<Vec<Figures>> {
    let cfg = dir.join(format!("{name}.yaml"));
    std::fs::write(&cfg, yaml).with_context(|| format!("writing {}", cfg.display()))?;
    let exe = std::env::current_exe().context("locating flotilla")?;
    let out = dir.join(name);
    let stderr_path = dir.join(format!("{name}.stderr"));
    let stderr_file = std::fs::File::create(&stderr_path)
        .with_context(|| format!("creating {}", stderr_path.display()))?;
    let mut child = Command::new(exe)
        .args(["launch"])
        .arg(&cfg)
        .arg("--output")
        .arg(&out)
        // Not piped: a pipe nobody drains while the job runs would block it when full.
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::from(stderr_file))
        .spawn()
        .context("starting a bench job")?;
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("bench job {name} exceeded {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        bail!(
            "bench job {name} failed:\n{}",
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        );
    }
    let path = out.join("summary.json");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let summary: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let ranks = summary["ranks"]
        .as_array()
        .with_context(|| format!("{} has no ranks", path.display()))?;
    Ok(ranks
        .iter()
        .map(|r| {
            r["figures"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect())
}
