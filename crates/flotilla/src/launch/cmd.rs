//! `flotilla launch`: writes the effective config, starts the ranks of `flotilla train` on it
//! (N local processes, or over ssh on the hosts of `--inventory`: [`crate::launch::inventory`]),
//! relays what they print (a progress bar from rank 0's events), and at the end merges their
//! timelines. Rank 0 writes the run's `summary.json` and plots itself ([`flotilla_rank::report`]), as
//! it does when started by another launcher (over ssh, on its host; the launcher copies the
//! hosts' outputs back).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use flotilla_cluster::Topology;
use flotilla_train::TrainConfig;
use flotilla_train::config::Elasticity;

use crate::cli::LaunchArgs;
use crate::job_secret::JobSecret;
use crate::launch::elastic::SlotCommand;
use crate::launch::inventory::{self, Remote};
use crate::launch::relay::Relay;
use crate::launch::{self, LocalJob, replace};
use crate::rendezvous_socket::{self, RendezvousSocket};
use crate::run_args::RunArgs;
use crate::settings;
use crate::{binding, capacity};
use flotilla_rank::progress::PROGRESS_ENV;
use flotilla_rank::telemetry;

/// A job ready to start: its config (as the ranks will read it) and shape.
struct Prepared {
    config: TrainConfig,
    config_path: PathBuf,
    topology: Topology,
    n: usize,
    /// The ranks' hosts, when launched on an inventory.
    placement: Option<flotilla_cluster::Placement>,
    /// Rank 0's listener, bound by the launcher for a local job (handed to rank 0 at start).
    socket: Option<RendezvousSocket>,
}

/// Runs `flotilla launch`.
pub fn run(args: &LaunchArgs) -> Result<()> {
    // Removed when the launch ends, every start of the job included.
    let _confined = (args.memory_per_rank)
        .map(launch::memory_limit::confine_ranks)
        .transpose()?;
    if !args.program.is_empty() {
        return crate::launch::program::run(args);
    }
    let config = settings::effective_config(&args.run, false)?;
    launch(config, args)
}

/// Starts the ranks of `config` (on this machine, or on the hosts of its inventory) and
/// supervises them to the end; the rendezvous is a free port on 127.0.0.1 (or on rank 0's
/// host) unless the flags of `opts.run` name one; `opts` also gives the threads per rank,
/// `--oversubscribe`, how remote ranks are started, and `--max-restarts`: when a rank fails,
/// the whole job is started again from the newest checkpoint, up to that many times (each
/// restart logged with its cause).
pub fn launch(mut config: TrainConfig, opts: &LaunchArgs) -> Result<()> {
    let generations = config.elasticity() == Some(Elasticity::Generations);
    let on_hosts = config.topology.inventory.is_some();
    launch::memory_limit::refuse_remote(on_hosts)?;
    if opts.max_restarts > 0 && on_hosts && !generations {
        let topology = config.topology()?;
        if flotilla_train::rejoin::rejoinable(&config, &topology).is_empty() {
            anyhow::bail!(
                "--max-restarts with --inventory replaces a lost worker alone (an async or \
                 elastic parameter server's) or a lost process of an elastic job (-n MIN:MAX); \
                 this job has neither, and a whole-job restart resumes from the checkpoint, \
                 which an ssh job cannot yet: use it with a local launch"
            );
        }
    }
    // Checked before anything is made for the job (its secret, its files), as each rank
    // would check it.
    config.validate()?;
    // One secret for every start of the job (a restart, a rejoining worker), removed at the end.
    let secret = JobSecret::for_job(&config)?;
    let mut restarts = 0;
    if generations {
        // Elastic peers replace lost processes themselves; the job never restarts as a
        // whole. (An elastic parameter server's workers are replaced alone, below; a lost
        // server restarts the job from its checkpoint.)
        return launch_once(config, opts, &secret, true, &mut restarts)?;
    }
    loop {
        let first = restarts == 0;
        match launch_once(config.clone(), opts, &secret, first, &mut restarts)? {
            Ok(()) => return Ok(()),
            // Over ssh only workers are started again (alone, above): no whole-job restart.
            Err(failure) if !on_hosts && restarts < opts.max_restarts && !launch::interrupted() => {
                restarts += 1;
                launch::restart_for(&mut config, &failure, (restarts, opts.max_restarts));
            }
            Err(failure) => return Err(failure),
        }
    }
}

/// One start of the job with `secret`: `Err` if it could not start, `Ok(Err)` if a rank
/// failed. `first`: not a restart (notes about the setup are printed once). `restarts`:
/// restarts so far (of the job or of single ranks), counted on when a worker restarted alone
/// rejoins the job.
fn launch_once(
    config: TrainConfig,
    opts: &LaunchArgs,
    secret: &JobSecret,
    first: bool,
    restarts: &mut u32,
) -> Result<Result<()>> {
    let (threads, remote_args) = (opts.threads, &opts.remote);
    // TLS files that cannot be read fail here, before any rank starts (local ranks read the
    // same ones; remote ones: `launch::tls`).
    let tls = crate::launch::tls::check(&config)?;
    let mut job = prepare(config, &opts.run)?;
    if let (true, Some(files)) = (first, &tls) {
        println!(
            "[launcher] TLS on every connection (mutual, cluster CA {})",
            files.ca.display()
        );
    }
    if job.placement.is_none() {
        check_local(&job, opts, first)?;
    }
    launch::stop_on_interrupt()?;
    let remote = match job.placement.take() {
        Some(placement) => Some(inventory::prepare(
            &job.config,
            &placement,
            remote_args,
            secret.secret(),
        )?),
        None => None,
    };
    let cpus = local_cpus(&job, opts.bind, threads);
    let generations = job.config.elasticity() == Some(Elasticity::Generations);
    let mut ranks = match &remote {
        Some(r) if generations => start_elastic(&mut job, Some(r), (threads, None), secret, opts)?,
        Some(r) => start_remote(&job, r, threads)?,
        None if generations => {
            start_elastic(&mut job, None, (threads, cpus.clone()), secret, opts)?
        }
        None => start_local(&mut job, threads, cpus.clone(), secret, first)?,
    };
    let make: replace::Make = match &remote {
        // On its host, over ssh, as the job's ranks were started.
        Some(r) => r.rank_command(rank_env(&job, threads), None),
        None => local_rank_command(&job, threads, cpus, secret),
    };
    let budget = (*restarts, opts.max_restarts);
    replace::workers(&mut ranks, (&job.config, &job.topology), make, budget);
    let mut relay = Relay::new(rank_labels(&job, remote.as_ref()));
    // An elastic job's rank 0 at the end may be any process.
    relay.any_final_line = generations;
    let result = ranks.supervise(None, &mut |line| relay.on_line(line));
    *restarts += ranks.respawned();
    relay.clear_bar();
    drop(ranks);
    let config = &job.config;
    if let Some(r) = &remote {
        // Also after a failure: the ranks' run.logs are where to look.
        r.fetch_outputs(&config.telemetry.output);
    }
    if let Some(dest) = &config.telemetry.timeline_path {
        // Also after a failure: the timeline of a failed job is where to look.
        match telemetry::merge_rank_timelines(&config.telemetry.output, job.n, dest) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("warning: merging the timeline: {e:#}"),
        }
    }
    if let Err(failure) = result {
        return Ok(Err(failure));
    }
    match relay.final_line {
        Some(line) => println!("{line}"),
        None => anyhow::bail!("rank 0 exited without a final line"),
    }
    Ok(Ok(()))
}

/// What a job on this host needs, checked once here rather than by every rank after all
/// started: its data path, the host's cores and memory (unless `--oversubscribe`), and the
/// GPUs of a GPU device (said on the `first` start).
fn check_local(job: &Prepared, opts: &LaunchArgs, first: bool) -> Result<()> {
    let data = job.config.data.source();
    anyhow::ensure!(
        data.path().exists(),
        "the data path {} does not exist (data.path, --data); no rank was started",
        data.path().display()
    );
    if !opts.oversubscribe {
        capacity::check_local(job.n, data.path())?;
    }
    if let Some(limit) = launch::memory_limit::limit() {
        let model = capacity::config_model_state(&job.config, job.n)?;
        let footprint = capacity::rank_footprint(data.path());
        capacity::check_limit(job.n, footprint, Some(model), limit)?;
    }
    let nccl = job.config.comm.backend == flotilla_train::config::Backend::Nccl;
    let device = &job.config.model.device;
    if let Some(gpus) = crate::gpu_placement::check_local(job.n, device, nccl, opts.oversubscribe)?
        && first
    {
        println!(
            "[launcher] {} rank(s) on device {}: GPU {gpus:?} by rank",
            job.n, job.config.model.device
        );
    }
    Ok(())
}

/// How a rank of this host is started again, alone: the same command and environment
/// (see [`replace::workers`], which adds the rejoin variable).
fn local_rank_command(
    job: &Prepared,
    threads: usize,
    cpus: Option<Vec<String>>,
    secret: &JobSecret,
) -> replace::Make {
    let env = local_env(rank_env(job, threads), cpus, secret.rank_env());
    let config_path = job.config_path.clone();
    Box::new(move |rank, more| {
        let exe = std::env::current_exe().context("locating the flotilla executable")?;
        let mut cmd = Command::new(exe);
        cmd.arg("train").arg(&config_path).envs(env(rank));
        cmd.envs(more.iter().map(|(k, v)| (k, v)));
        Ok(cmd)
    })
}

/// Starts the ranks on this host, each on its cores when `cpus` binds them (said on the
/// `first` start), with the job's `secret`; rank 0 takes the rendezvous socket (the
/// launcher's copy is closed once rank 0 holds it).
fn start_local(
    job: &mut Prepared,
    threads: usize,
    cpus: Option<Vec<String>>,
    secret: &JobSecret,
    first: bool,
) -> Result<LocalJob> {
    if let (true, Some(lists)) = (first, &cpus) {
        println!("[launcher] {}", binding::describe(lists));
    }
    let train: [OsString; 2] = ["train".into(), job.config_path.clone().into_os_string()];
    let env = local_env(rank_env(job, threads), cpus, secret.rank_env());
    let socket = job.socket.take();
    LocalJob::spawn(job.n, &train, env, socket.as_ref())
}

/// Starts an elastic job's processes around its lighthouse here
/// ([`crate::launch::elastic`]): on this host, or over ssh on `remote`'s hosts (process `k`
/// on the host of rank `k`, a replacement round the hosts).
fn start_elastic(
    job: &mut Prepared,
    remote: Option<&Remote>,
    (threads, cpus): (usize, Option<Vec<String>>),
    secret: &JobSecret,
    opts: &LaunchArgs,
) -> Result<LocalJob> {
    let socket = job
        .socket
        .take()
        .context("the lighthouse's port was not bound")?;
    let config_path = job.config_path.clone();
    let join_with = format!("flotilla train {}", config_path.display());
    let (command, stop, tls): (SlotCommand, _, _) = match remote {
        Some(r) => {
            r.record(&job.config.telemetry.output)?;
            let command = r.slot_command(rank_env(job, threads), None);
            (command, Some(r.stop_hook()?), r.lighthouse_tls.clone())
        }
        None => {
            let env = local_env(rank_env(job, threads), cpus, secret.rank_env());
            let exe = std::env::current_exe().context("locating the flotilla executable")?;
            let command = Box::new(move |index, vars: &[(String, String)]| {
                let mut cmd = Command::new(&exe);
                cmd.arg("train").arg(&config_path).envs(env(index));
                cmd.envs(vars.iter().map(|(k, v)| (k, v)));
                Ok(cmd)
            });
            (command, None, None)
        }
    };
    crate::launch::elastic::start(crate::launch::elastic::Start {
        config: &job.config,
        command,
        stop,
        tls,
        join_with,
        socket,
        secret,
        restarts: opts.max_restarts,
        start: opts.start_ranks,
    })
}

/// Starts the ranks on their inventory hosts (the job id printed and recorded first).
fn start_remote(job: &Prepared, remote: &Remote, threads: usize) -> Result<LocalJob> {
    remote.record(&job.config.telemetry.output)?;
    let inventory = job.config.topology.inventory.as_ref();
    println!(
        "[launcher] job {id} (stop it with: flotilla stop --inventory {} --job {id})",
        inventory.map_or(String::new(), |p| p.display().to_string()),
        id = remote.job.job_id,
    );
    remote.start(rank_env(job, threads))
}

/// The config with a rendezvous address, checked and written for the ranks. A local job's
/// port is bound here, before it is written anywhere ([`RendezvousSocket`]).
fn prepare(mut config: TrainConfig, flags: &RunArgs) -> Result<Prepared> {
    let placement = match &config.topology.inventory {
        Some(path) => Some(inventory::placement(&config, path)?),
        None => None,
    };
    if !flags.given("master-addr") {
        // Rank 0's host is the rendezvous; every other rank binds the address it reaches
        // rank 0 from (its own host's), so peers connect to each other's hosts.
        config.comm.master_addr = placement
            .as_ref()
            .and_then(|p| p.address(0))
            .unwrap_or("127.0.0.1")
            .to_owned();
    }
    let generations = config.elasticity() == Some(Elasticity::Generations);
    if generations && !flags.given("master-addr") {
        // An elastic job's membership is kept here, by the launcher's lighthouse: the ranks
        // reach it at this host's address toward rank 0's host.
        if let Some(to) = placement.as_ref().and_then(|p| p.address(0)) {
            config.comm.master_addr = rendezvous_socket::address_toward(to)?;
        }
    }
    let local = placement.is_none() || generations;
    let socket = rendezvous_socket::for_job(&mut config, flags, local)?;
    let spec = config.validate()?;
    if config.topology.arch == flotilla_cluster::Arch::Pipeline {
        // Planned here, before any rank starts: a model that does not fit is refused, and the
        // ranks run the cut printed here (an automatic cut is measured once, not again).
        let plan = flotilla_train::pipeline::plan(&config, &spec)?;
        print!("{}", plan.describe(&config));
        config.pipeline.split_points = None;
        config.pipeline.stages = flotilla_train::config::StagesSetting::Ranges(
            plan.ranges().iter().map(|r| [r.start, r.end - 1]).collect(),
        );
    }
    let n = config.effective_world_size()?;
    if flags.given("world-size") && config.topology.world_size != n {
        let t = &config.topology;
        let (asked, elastic) = match t.min_world_size {
            Some(min) => (
                format!("{min}:{}", t.world_size),
                format!(" (`-n MIN:{n}`)"),
            ),
            None => (t.world_size.to_string(), String::new()),
        };
        anyhow::bail!(
            "-n {asked}: this job's size comes from its config, not from -n: {n} ranks \
             ({}){elastic}. A pipeline has stages × data_parallel ranks (`data_parallel: 2` in \
             the config for 2 replicas of every stage); a hierarchical parameter server one per \
             server and worker",
            config.topology()?.composition()
        );
    }
    let output = &config.telemetry.output;
    std::fs::create_dir_all(output).with_context(|| format!("creating {}", output.display()))?;
    let config_path = output.join("launch-config.yaml");
    std::fs::write(&config_path, serde_norway::to_string(&config)?)
        .with_context(|| format!("writing {}", config_path.display()))?;
    println!(
        "launching {n} ranks of {} on {} (output {})",
        spec.name,
        rendezvous_socket::describe(&config.comm.master_addr, config.comm.master_port),
        output.display()
    );
    let topology = config.topology()?;
    if topology.arch() != flotilla_cluster::Arch::Allreduce || placement.is_some() {
        let shown = placement
            .clone()
            .unwrap_or_else(|| flotilla_cluster::Placement::local(&topology));
        for line in shown.describe().lines() {
            println!("{line}");
        }
    }
    Ok(Prepared {
        config,
        config_path,
        topology,
        n,
        placement,
        socket,
    })
}

/// Each rank's environment: its place in the job, events for this launcher, and the
/// per-rank thread count for every thread pool a backend may use (rayon for flex,
/// OpenMP/MKL for LibTorch) unless the caller set it: an oversubscribed OpenMP pool collapses.
fn rank_env(job: &Prepared, threads: usize) -> impl Fn(usize) -> Vec<(String, String)> + use<> {
    let threads = threads.max(1).to_string();
    let mut common: Vec<(String, String)> =
        ["RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"]
            .iter()
            .map(|k| {
                let v = std::env::var(k).unwrap_or_else(|_| threads.clone());
                (k.to_string(), v)
            })
            .collect();
    let comm = &job.config.comm;
    common.extend([
        ("WORLD_SIZE".to_string(), job.n.to_string()),
        ("MASTER_ADDR".to_string(), comm.master_addr.clone()),
        ("MASTER_PORT".to_string(), comm.master_port.to_string()),
        (PROGRESS_ENV.to_string(), "1".to_string()),
    ]);
    common.extend(launch::burn_device_env(&job.config));
    move |rank| {
        let mut env = vec![("RANK".to_string(), rank.to_string())];
        env.extend(common.iter().cloned());
        env
    }
}

/// A local rank's environment: `env`, its `LOCAL_RANK`, which is its rank (all share this
/// host; its GPU index comes from it), its cores when `cpus` binds them (see [`binding`]),
/// and where the job's `secret` is when the launcher made it. Remote launches set theirs per
/// host.
fn local_env(
    env: impl Fn(usize) -> Vec<(String, String)>,
    cpus: Option<Vec<String>>,
    secret: Option<(String, String)>,
) -> impl Fn(usize) -> Vec<(String, String)> {
    move |rank| {
        let mut vars = env(rank);
        vars.push(("LOCAL_RANK".to_string(), rank.to_string()));
        vars.extend(binding::rank_var(cpus.as_deref(), rank));
        vars.extend(secret.clone());
        vars
    }
}

/// How each rank's lines are prefixed: `rank R`, its role unless all ranks are all-reduce
/// peers, and `@ host` when it runs on an inventory host.
fn rank_labels(job: &Prepared, remote: Option<&Remote>) -> Vec<String> {
    (0..job.n)
        .map(|r| {
            let mut label = format!("rank {r}");
            if job.topology.arch() != flotilla_cluster::Arch::Allreduce {
                label.push(' ');
                label.push_str(&job.topology.label(r));
            }
            if let Some(remote) = remote {
                label.push_str(" @ ");
                label.push_str(remote.host_name(r));
            }
            label
        })
        .collect()
}

/// The cores of each local rank under `bind` (see `binding::plan`), `None` when unbound.
fn local_cpus(job: &Prepared, bind: binding::Bind, threads: usize) -> Option<Vec<String>> {
    let allowed = binding::allowed_cpus();
    binding::plan(bind, job.n, threads, &allowed, all_compute(&job.topology))
}

/// Whether every rank of `topology` computes (see `binding::plan`): not when it has parameter
/// servers, which mostly wait for their workers.
fn all_compute(topology: &Topology) -> bool {
    topology.servers().next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local rank gets its `LOCAL_RANK` and, when the job is bound, its own cores.
    #[test]
    fn a_local_rank_gets_its_own_cores_when_the_job_is_bound() {
        let base = |r: usize| vec![("RANK".to_string(), r.to_string())];
        let bound = local_env(base, Some(vec!["0".into(), "1".into()]), None);
        let var = |env: Vec<(String, String)>, k: &str| {
            env.into_iter().find(|(key, _)| key == k).map(|(_, v)| v)
        };
        assert_eq!(var(bound(1), binding::CPUS_ENV).as_deref(), Some("1"));
        assert_eq!(var(bound(1), "LOCAL_RANK").as_deref(), Some("1"));
        let unbound = local_env(base, None, None);
        assert_eq!(var(unbound(1), binding::CPUS_ENV), None);
    }

    /// A job of all-reduce peers computes on every rank; one with parameter servers does not
    /// (so `--bind auto` leaves it unbound).
    #[test]
    fn only_jobs_without_servers_compute_on_every_rank() {
        assert!(all_compute(&Topology::allreduce(4).expect("topology")));
        let spec = flotilla_cluster::TopologySpec::from_yaml(
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
            "test",
        )
        .expect("spec");
        assert!(!all_compute(&Topology::build(&spec).expect("topology")));
    }
}
