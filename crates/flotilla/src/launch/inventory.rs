//! `flotilla launch --inventory`: the job's ranks on the inventory's hosts over ssh.
//!
//! Before any rank starts, the launcher creates the job directory on every host and writes the
//! ranks' config into it; with `--sync` also the binary (`flotilla`) and a model spec file
//! (`model.yaml`). Without `--sync` the hosts run the binary at the launcher's own path (or
//! `--remote-exe`). The data path is the user's: it must exist at the same path on every host
//! (a relative one is made absolute against the launcher's directory). At the end (also after
//! a failure) each host's `<job dir>/output` is copied into the local output directory, so the
//! ranks' `run.log`s, timelines and rank 0's metrics and checkpoints end up where a local run
//! puts them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use flotilla_cluster::{Inventory, Placement, place};
use flotilla_train::TrainConfig;
use serde_json::json;

use crate::cli::RemoteArgs;
use crate::launch::remote::{
    self, REMOTE_CONFIG, REMOTE_EXE, REMOTE_OUTPUT, REMOTE_SECRET, RemoteJob,
};
use crate::launch::tls::RemoteTls;
use crate::launch::{LocalJob, StopHook};
use flotilla_tcp::Secret;

/// The model spec file's name in the job directory, when `--sync` copied it.
const REMOTE_MODEL: &str = "model.yaml";

/// A job placed on inventory hosts, its files in place, not yet started.
pub struct Remote {
    /// Where the job lives on its hosts.
    pub job: RemoteJob,
    /// The TLS files as the ranks find them on their hosts.
    pub tls: Option<flotilla_train::config::TlsSetting>,
    /// How long rank 0 may take to bind a port on its host and say it, when it picks one
    /// (`master_port` 0: the other ranks start once it has); `None` when the port is given.
    port_wait: Option<Duration>,
    /// An elastic job's lighthouse's TLS (on this host, at `comm.master_addr`), loaded
    /// before the job's made files are removed; `None` without TLS or when not elastic.
    pub lighthouse_tls: Option<flotilla_tcp::TlsConfig>,
    /// The port rank 0 said it listens on, once it has (when it picks one).
    announced: std::sync::OnceLock<u16>,
}

/// Places the job's ranks on the inventory's hosts (rank `i` on host `i`).
pub fn placement(config: &TrainConfig, inventory: &Path) -> Result<Placement> {
    let inventory = Inventory::load(inventory)?;
    Ok(place(&config.topology()?, &inventory)?)
}

/// Creates the job directory on every host and writes the ranks' files into it, `secret`
/// among them when the job has one (the launcher's [`crate::job_secret::JobSecret`]).
pub fn prepare(
    config: &TrainConfig,
    placement: &Placement,
    args: &RemoteArgs,
    secret: Option<&Secret>,
) -> Result<Remote> {
    if config.schedule.resume {
        bail!(
            "--resume with --inventory is not supported: each ssh job has a directory of its own \
             on its hosts; resume with a local launch or with ranks started by mpirun / Slurm"
        );
    }
    let local_exe = std::env::current_exe().context("locating the flotilla executable")?;
    let exe = match (&args.remote_exe, args.sync) {
        (_, true) => format!("./{REMOTE_EXE}"),
        (Some(p), false) => p.clone(),
        (None, false) => local_exe.display().to_string(),
    };
    let mut job = RemoteJob::new(placement, &args.remote_dir, exe)?;
    let (mut ranks_config, model_file) = ranks_config(config, args.sync)?;
    // TLS: each host's `flotilla certs` files copied into its job directory (0600), or the
    // configured paths on the hosts.
    // 0700: it holds the job's secret and TLS keys until they are copied.
    let staging = tempfile::Builder::new()
        .prefix("flotilla-staging-")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .tempdir()
        .context("creating a staging directory")?;
    let generations = config.elasticity() == Some(flotilla_train::config::Elasticity::Generations);
    let lighthouse = generations.then_some(config.comm.master_addr.as_str());
    let tls = RemoteTls::plan(config, &job.hosts(), lighthouse, staging.path())?;
    let lighthouse_tls = match lighthouse.and_then(|a| tls.files_for(a)) {
        Some(files) => Some(files.load().with_context(|| {
            format!(
                "TLS of the elastic job's lighthouse at {} (this host): its certificate",
                config.comm.master_addr
            )
        })?),
        None => None,
    };
    ranks_config.comm.tls = tls.ranks_setting();
    let ranks_tls = ranks_config.comm.tls.clone();
    let config_file = staging.path().join(REMOTE_CONFIG);
    std::fs::write(&config_file, serde_norway::to_string(&ranks_config)?)
        .with_context(|| format!("writing {}", config_file.display()))?;
    // The secret goes to every host in a mode-0600 file of the job directory, never on a
    // command line.
    let secret_file = staging.path().join(REMOTE_SECRET);
    if let Some(secret) = secret {
        secret.write_private(&secret_file)?;
        job.secret = true;
    }
    for target in job.hosts() {
        println!(
            "[launcher] {}: job directory {} ({})",
            target.name,
            job.dir,
            if args.sync {
                "copying the binary, config and model"
            } else {
                "writing the config"
            }
        );
        remote::copy_file(target, &config_file, &job.dir, REMOTE_CONFIG, "600")?;
        if job.secret {
            remote::copy_file(target, &secret_file, &job.dir, REMOTE_SECRET, "600")?;
        }
        tls.copy_to(target, &job.dir)?;
        if args.sync {
            remote::copy_file(target, &local_exe, &job.dir, REMOTE_EXE, "700")?;
            if let Some(model) = &model_file {
                remote::copy_file(target, model, &job.dir, REMOTE_MODEL, "600")?;
            }
        }
    }
    let port_wait = (config.comm.master_port == 0)
        .then(|| Duration::try_from_secs_f64(config.comm.join_timeout_s).ok())
        .flatten();
    Ok(Remote {
        job,
        tls: ranks_tls,
        port_wait,
        lighthouse_tls,
        announced: std::sync::OnceLock::new(),
    })
}

/// The config the ranks read on their hosts: output in the job directory, absolute data
/// path, the model spec file copied (`--sync`) or at its absolute path, no inventory (the
/// launcher placed the ranks). Also returns the local model spec file to copy, if any.
fn ranks_config(config: &TrainConfig, sync: bool) -> Result<(TrainConfig, Option<PathBuf>)> {
    let mut c = config.clone();
    c.telemetry.output = PathBuf::from(REMOTE_OUTPUT);
    c.topology.inventory = None;
    // A local path; the ranks read the secret from the job directory.
    c.comm.secret_file = None;
    let source = c.data.source();
    c.data.path = source.at(absolute(source.path())?).to_path();
    let spec_path = Path::new(&c.model.spec);
    let mut model_file = None;
    if spec_path.is_file() {
        let abs = absolute(spec_path)?;
        if sync {
            c.model.spec = REMOTE_MODEL.to_owned();
            model_file = Some(abs);
        } else {
            c.model.spec = abs.display().to_string();
        }
    }
    Ok((c, model_file))
}

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))
}

impl Remote {
    /// Starts every rank over ssh; `env(rank)` is its environment (`LOCAL_RANK` is added).
    /// Stopping the job early ends the remote ranks through their recorded pids.
    pub fn start(&self, env: impl Fn(usize) -> Vec<(String, String)>) -> Result<LocalJob> {
        self.start_running(env, None)
    }

    /// As [`Remote::start`], running `program` (path on the hosts, then its arguments)
    /// instead of `flotilla train` when given. When rank 0 picks its port, it starts first
    /// and the others once it has said the port ([`LocalJob::announced_port`]), with
    /// `MASTER_PORT` set to it.
    pub fn start_running(
        &self,
        env: impl Fn(usize) -> Vec<(String, String)>,
        program: Option<&[String]>,
    ) -> Result<LocalJob> {
        let n = self.job.ranks.len();
        let stop = self.stop_hook()?;
        let mut ranks = LocalJob::start([self.command(0, env(0), program)?], Some(stop))?;
        let port = match self.port_wait {
            Some(wait) => {
                let port = ranks.announced_port(wait)?;
                println!(
                    "[launcher] rank 0 listens on port {port} of {}; starting the other ranks",
                    self.host_name(0)
                );
                let _ = self.announced.set(port);
                Some(port)
            }
            None => None,
        };
        let rest = (1..n).map(|rank| self.command(rank, at_port(env(rank), port), program));
        ranks.start_more(rest.collect::<Result<Vec<_>>>()?)?;
        Ok(ranks)
    }

    /// What ends the job's processes on every host (through their recorded pids) when the
    /// job ends early.
    pub fn stop_hook(&self) -> Result<StopHook> {
        let job = self.job.clone();
        let dirs = flotilla_cluster::ssh::quote(&job.dir)?;
        Ok(Box::new(move || {
            let (lines, failures) = remote::stop_on_hosts(&job.hosts(), &dirs);
            for line in lines {
                eprintln!("[launcher] {line}");
            }
            for f in failures {
                eprintln!("[launcher] warning: {f}; end its ranks with `flotilla stop`");
            }
        }))
    }

    /// The ssh command of an elastic job's process `index`: `flotilla train`, or `program`
    /// (path on the hosts, then its arguments), with `env(index)` and the slot's variables,
    /// on the host of rank `index` modulo the inventory's ranks (a replacement goes round the
    /// hosts), owning nothing of the launcher.
    pub fn slot_command(
        &self,
        env: impl Fn(usize) -> Vec<(String, String)> + Send + 'static,
        program: Option<Vec<String>>,
    ) -> crate::launch::elastic::SlotCommand {
        let job = self.job.clone();
        Box::new(move |index, vars| {
            let rank = index % job.ranks.len().max(1);
            let mut all = env(index);
            all.extend_from_slice(vars);
            rank_command(&job, rank, all, program.as_deref())
        })
    }

    /// What starts a rank of this job again on its host (a lost worker, which rejoins the
    /// running job: `crate::launch::replace`): `flotilla train`, or `program` (path on the
    /// hosts, then its arguments), with `env(rank)`, at the port rank 0 said (once the job
    /// started).
    pub fn rank_command(
        &self,
        env: impl Fn(usize) -> Vec<(String, String)> + Send + 'static,
        program: Option<Vec<String>>,
    ) -> crate::launch::replace::Make {
        let job = self.job.clone();
        let port = self.announced.get().copied();
        Box::new(move |rank, more| {
            let mut vars = at_port(env(rank), port);
            vars.extend_from_slice(more);
            rank_command(&job, rank, vars, program.as_deref())
        })
    }

    /// The ssh command that runs `rank` with `vars` (see [`rank_command`]).
    fn command(
        &self,
        rank: usize,
        vars: Vec<(String, String)>,
        program: Option<&[String]>,
    ) -> Result<Command> {
        rank_command(&self.job, rank, vars, program)
    }

    /// Removes the job's credentials (the secret and the TLS files) from every host's job
    /// directory: they are only needed while the ranks run (failures are reported).
    fn remove_credentials(&self) {
        for target in self.job.hosts() {
            if let Err(e) = remote::remove_credentials(target, &self.job.dir) {
                eprintln!("warning: {e:#}");
            }
        }
    }

    /// Copies every host's job output into `dest` (failures are reported, not fatal).
    pub fn fetch_outputs(&self, dest: &Path) {
        for target in self.job.hosts() {
            if let Err(e) = remote::fetch_output(target, &self.job.dir, dest) {
                eprintln!("warning: {e:#}");
            }
        }
    }

    /// `<output>/job.json`: the job id, its directory and each rank's host (what `flotilla
    /// stop --job` needs).
    pub fn record(&self, output: &Path) -> Result<()> {
        let ranks: Vec<_> = self
            .job
            .ranks
            .iter()
            .enumerate()
            .map(|(r, t)| json!({"rank": r, "host": t.name, "destination": t.destination(), "port": t.port}))
            .collect();
        let body = json!({"job_id": self.job.job_id, "dir": self.job.dir, "ranks": ranks});
        let path = output.join("job.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&body)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The label of `rank` in relayed lines: `rank R <role> @ host`.
    pub fn host_name(&self, rank: usize) -> &str {
        self.job.ranks.get(rank).map_or("", |t| t.name.as_str())
    }
}

/// `vars` with `MASTER_PORT` the port rank 0 said, if it picked one.
fn at_port(mut vars: Vec<(String, String)>, port: Option<u16>) -> Vec<(String, String)> {
    if let Some(port) = port {
        vars.retain(|(k, _)| k != "MASTER_PORT");
        vars.push(("MASTER_PORT".into(), port.to_string()));
    }
    vars
}

/// The ssh command that runs `rank` of `job` with `vars` (`LOCAL_RANK` added), out of the
/// terminal's process group: Ctrl-C reaches the launcher, which stops the remote ranks before
/// it ends their ssh clients.
fn rank_command(
    job: &RemoteJob,
    rank: usize,
    mut vars: Vec<(String, String)>,
    program: Option<&[String]>,
) -> Result<Command> {
    vars.push(("LOCAL_RANK".into(), job.local_rank(rank).to_string()));
    let mut cmd: Command = match program {
        Some(words) => job.program_command(rank, &vars, words)?,
        None => job.rank_command(rank, &vars)?,
    };
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    Ok(cmd)
}

/// The job's credentials leave the hosts with it, however the launch ends (its ranks are
/// stopped before: a `Remote` outlives the job it started).
impl Drop for Remote {
    fn drop(&mut self) {
        self.remove_credentials();
    }
}
