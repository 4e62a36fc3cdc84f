//! `flotilla launch -n N -- PROGRAM ARGS...`: any program as the N ranks of a job, as torchrun
//! starts Python programs. Each rank gets the torchrun variables (`RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), every other setting the launcher was given
//! in the schema's names (`FLOTILLA_COMM__TIMEOUT_S`, ...: [`TrainConfig::settings_env`]),
//! the secret (inherited, or `FLOTILLA_SECRET_FILE`: the user's, or one the launcher made for
//! the job, [`JobSecret`]) and TLS files (`FLOTILLA_TLS_*`), which `flotilla_burn::init`
//! (`flotilla_train::program`) reads; rank 0 of a local job also
//! inherits the rendezvous socket the launcher bound (`FLOTILLA_LISTEN_FD`,
//! [`crate::rendezvous_socket`]), which `TcpGroup::connect` takes, at a port of its own
//! (`FLOTILLA_COMM__MASTER_PORT`): `MASTER_PORT` stays free for a program that binds it
//! itself, as torch's does ([`ports`]). The ranks
//! are supervised as `flotilla train` ranks are ([`LocalJob::supervise`]): the first failure
//! stops them all and is named with its stderr, no rank outlives the launcher, Ctrl-C stops
//! them, and `--max-restarts` starts the whole program again with `schedule.resume` set (a
//! program on `flotilla_burn::train` resumes from the newest checkpoint). `-n MIN:MAX` makes
//! it an elastic job ([`crate::launch::elastic`]: a program on `flotilla_burn::train` or
//! `::session` trains on without a lost rank, which a new process of the program replaces).
//! With `--inventory` the ranks run on the hosts over ssh
//! ([`crate::launch::inventory`]); the program must be at the same path on every host.

use std::ffi::OsString;
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use flotilla_tcp::{SECRET_FILE_ENV, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsFiles};
use flotilla_train::TrainConfig;
use flotilla_train::config::keys;

use crate::binding;
use crate::cli::LaunchArgs;
use crate::job_secret::JobSecret;
use crate::launch::inventory;
use crate::launch::relay::Relay;
use crate::launch::{self, LocalJob, replace};
use crate::settings;
use flotilla_rank::telemetry;

/// Runs `flotilla launch ... -- PROGRAM ARGS...`.
pub fn run(args: &LaunchArgs) -> Result<()> {
    let sources = settings::sources(&args.run, false)?;
    let config = sources.extract()?;
    check_given_data(&sources, &config)?;
    launch(config, args)
}

/// A data path the user gave (flag, environment or file) must exist: refused once here,
/// before any rank starts, rather than by every rank. The default path is not checked: a
/// program may read data of its own.
fn check_given_data(sources: &settings::Sources, config: &TrainConfig) -> Result<()> {
    let given = sources
        .provenance()?
        .into_iter()
        .find(|p| p.path == "data.path" && p.source != "default");
    let path = config.data.source();
    match given {
        Some(p) if !path.path().exists() => bail!(
            "the data path {} does not exist (data.path, from {}); no rank was started",
            path.path().display(),
            p.source
        ),
        _ => Ok(()),
    }
}

/// Starts `args.program` as the ranks of the job `config` describes (supervised, restarted
/// up to `args.max_restarts` times): `flotilla launch -- PROGRAM`, and each strategy of
/// `flotilla compare -- PROGRAM`.
pub fn launch(mut config: TrainConfig, args: &LaunchArgs) -> Result<()> {
    // Checked once here, as each rank would check it (`flotilla_train::program::settings`).
    config.validate()?;
    // One secret for every start of the program, removed at the end.
    let secret = JobSecret::for_job(&config)?;
    let mut restarts = 0;
    if generations(&config) {
        // An elastic job replaces lost processes itself; it never restarts as a whole.
        return launch_once(&config, args, &secret, &mut restarts)?;
    }
    loop {
        match launch_once(&config, args, &secret, &mut restarts)? {
            Ok(()) => return Ok(()),
            Err(failure) if restarts < args.max_restarts && !launch::interrupted() => {
                restarts += 1;
                launch::restart_for(&mut config, &failure, (restarts, args.max_restarts));
            }
            Err(failure) => return Err(failure),
        }
    }
}

/// Whether `config` is an elastic job of generations (peers or a pipeline's replicas), whose
/// membership the launcher's lighthouse keeps.
fn generations(config: &TrainConfig) -> bool {
    config.elasticity() == Some(flotilla_train::config::Elasticity::Generations)
}

/// One start of the program's ranks with `secret`: `Err` if they could not start, `Ok(Err)`
/// if one failed. `restarts`: restarts so far (of the job or of single ranks), counted on
/// when a worker restarted alone rejoins the job.
fn launch_once(
    config: &TrainConfig,
    args: &LaunchArgs,
    secret: &JobSecret,
    restarts: &mut u32,
) -> Result<Result<()>> {
    let mut config = config.clone();
    let n = config.effective_world_size()?;
    if n == 0 {
        bail!("-n 0: a job needs at least one rank");
    }
    let placement = match &config.topology.inventory {
        Some(path) => Some(inventory::placement(&config, path)?),
        None => None,
    };
    launch::memory_limit::refuse_remote(placement.is_some())?;
    if let Some(limit) = launch::memory_limit::limit() {
        let footprint = crate::capacity::rank_footprint(config.data.source().path());
        // A program builds its own model: the launcher does not know it.
        crate::capacity::check_limit(n, footprint, None, limit)?;
    }
    let elastic = generations(&config);
    if !args.run.given("master-addr") {
        let rank_0 = placement.as_ref().and_then(|p| p.address(0));
        config.comm.master_addr = match rank_0 {
            // An elastic job's lighthouse is here: the ranks reach it at this host's address
            // toward theirs.
            Some(to) if elastic => crate::rendezvous_socket::address_toward(to)?,
            Some(to) => to.to_owned(),
            None => "127.0.0.1".to_owned(),
        };
    }
    let (mut socket, program_port) = ports(&mut config, args, placement.is_none() || elastic)?;
    let program = program_words(&args.program)?;
    println!(
        "launching {n} ranks of {} on {}",
        program.join(" "),
        crate::rendezvous_socket::describe(&config.comm.master_addr, config.comm.master_port)
    );
    if let Some(p) = program_port {
        println!("[launcher] MASTER_PORT {p} is left free for the program's own rendezvous");
    }
    launch::stop_on_interrupt()?;
    let remote = match &placement {
        Some(p) => Some(inventory::prepare(
            &config,
            p,
            &args.remote,
            secret.secret(),
        )?),
        None => None,
    };
    let (mut ranks, make) = match &remote {
        Some(r) => {
            let tls = r.tls.as_ref().map(TlsFiles::from);
            let env = || rank_env(&config, (n, program_port), args.threads, tls.clone(), None);
            let ranks = match socket.take() {
                Some(socket) if elastic => {
                    let words = (env()?, program.clone());
                    start_elastic_remote(&config, args, r, words, (socket, secret))?
                }
                _ => r.start_running(env()?, Some(&program))?,
            };
            // A worker started again runs on its host, over ssh, as the ranks were started.
            (ranks, r.rank_command(env()?, Some(program.clone())))
        }
        None => start_here(&config, args, (n, program_port), (&mut socket, secret))?,
    };
    // The same policy as a config's job: whom the job goes on without, whom it restarts.
    let topology = config.topology()?;
    let budget = (*restarts, args.max_restarts);
    replace::workers(&mut ranks, (&config, &topology), make, budget);
    // Rank 0 (or the lighthouse) holds the rendezvous socket now; the launcher's copy would
    // keep the port open (queueing joins) after rank 0 ended.
    drop(socket);
    let labels = (0..n)
        .map(|r| match &remote {
            Some(remote) => format!("rank {r} @ {}", remote.host_name(r)),
            None => format!("rank {r}"),
        })
        .collect();
    let mut relay = Relay::new(labels);
    let result = ranks.supervise(None, &mut |line| relay.on_line(line));
    *restarts += ranks.respawned();
    relay.clear_bar();
    drop(ranks);
    collect_outputs(&config, remote.as_ref(), n);
    Ok(result)
}

/// The program's ranks on this host ([`start_local`]), and what starts one of them again.
fn start_here(
    config: &TrainConfig,
    args: &LaunchArgs,
    (n, program_port): (usize, Option<u16>),
    (socket, secret): (
        &mut Option<crate::rendezvous_socket::RendezvousSocket>,
        &JobSecret,
    ),
) -> Result<(LocalJob, replace::Make)> {
    let command = Arc::new(local_command(config, args, (n, program_port), secret)?);
    let ranks = start_local(config, args, Arc::clone(&command), (socket, secret))?;
    let make: replace::Make = Box::new(move |rank, more| {
        let mut cmd = (*command)(rank);
        cmd.envs(more.iter().map(|(k, v)| (k, v)));
        Ok(cmd)
    });
    Ok((ranks, make))
}

/// Starts an elastic program's processes on the inventory's hosts over ssh, around the
/// launcher's lighthouse here (which takes `socket`): process `k` on the host of rank `k`, a
/// replacement round the hosts.
fn start_elastic_remote(
    config: &TrainConfig,
    args: &LaunchArgs,
    remote: &inventory::Remote,
    (env, program): (
        impl Fn(usize) -> Vec<(String, String)> + Send + 'static,
        Vec<String>,
    ),
    (socket, secret): (crate::rendezvous_socket::RendezvousSocket, &JobSecret),
) -> Result<LocalJob> {
    let join_with = format!("{} (on a host of the inventory)", program.join(" "));
    crate::launch::elastic::start(crate::launch::elastic::Start {
        config,
        command: remote.slot_command(env, Some(program)),
        stop: Some(remote.stop_hook()?),
        tls: remote.lighthouse_tls.clone(),
        join_with,
        socket,
        secret,
        restarts: args.max_restarts,
        start: args.start_ranks,
    })
}

/// Starts the program's ranks on this host: `n` of them (rank 0 with the rendezvous
/// `socket`), or an elastic job's processes around the launcher's lighthouse (which takes
/// the socket).
fn start_local(
    config: &TrainConfig,
    args: &LaunchArgs,
    command: Arc<impl Fn(usize) -> Command + Send + Sync + 'static>,
    (socket, secret): (
        &mut Option<crate::rendezvous_socket::RendezvousSocket>,
        &JobSecret,
    ),
) -> Result<LocalJob> {
    let program = program_words(&args.program)?.join(" ");
    let n = config.effective_world_size()?;
    if generations(config) {
        let socket = socket.take().context("the rendezvous port was not bound")?;
        // A process started by hand takes the job's settings from this file (the ranks
        // have them in their environment).
        let output = &config.telemetry.output;
        std::fs::create_dir_all(output)
            .with_context(|| format!("creating {}", output.display()))?;
        let path = std::path::absolute(output.join("launch-config.yaml"))
            .context("the output directory")?;
        std::fs::write(&path, serde_norway::to_string(config)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let join_with = format!(
            "{}={} {program}",
            flotilla_train::program::CONFIG_ENV,
            path.display()
        );
        return crate::launch::elastic::start(crate::launch::elastic::Start {
            config,
            command: Box::new(move |index, vars| {
                let mut cmd = (*command)(index);
                cmd.envs(vars.iter().map(|(k, v)| (k, v)));
                Ok(cmd)
            }),
            stop: None,
            tls: None,
            join_with,
            socket,
            secret,
            restarts: args.max_restarts,
            start: args.start_ranks,
        });
    }
    let commands = (0..n).map(|rank| {
        let mut cmd = (*command)(rank);
        if let (0, Some(s)) = (rank, socket.as_ref()) {
            s.hand_to(&mut cmd);
        }
        cmd
    });
    LocalJob::start(commands, None).with_context(|| format!("starting {program}"))
}

/// Each local rank's command, by its index: the program with the rank's environment
/// ([`rank_env`]), its `LOCAL_RANK` and its cores when `--bind` names them.
fn local_command(
    config: &TrainConfig,
    args: &LaunchArgs,
    (n, program_port): (usize, Option<u16>),
    secret: &JobSecret,
) -> Result<impl Fn(usize) -> Command + Send + use<>> {
    let secret_file = (secret.made_file().map(std::path::Path::to_path_buf))
        .or_else(|| config.comm.secret_file.clone());
    let tls = crate::launch::tls::check(config)?;
    let env = rank_env(config, (n, program_port), args.threads, tls, secret_file)?;
    // The launcher cannot see which of a program's ranks compute: `auto` binds none.
    let allowed = binding::allowed_cpus();
    let cpus = binding::plan(args.bind, n, args.threads, &allowed, false);
    if let Some(lists) = &cpus {
        println!("[launcher] {}", binding::describe(lists));
    }
    let program = args.program.clone();
    Ok(move |rank: usize| {
        let mut cmd = Command::new(&program[0]);
        cmd.args(&program[1..]);
        cmd.envs(env(rank)).env("LOCAL_RANK", rank.to_string());
        cmd.envs(binding::rank_var(cpus.as_deref(), rank));
        cmd
    })
}

/// After the ranks ended (also after a failure, where they are where to look): the remote
/// ranks' outputs fetched, and the ranks' timelines merged when one was asked for (a
/// program on `flotilla_burn::train` records its as a config job's ranks do).
fn collect_outputs(config: &TrainConfig, remote: Option<&inventory::Remote>, n: usize) {
    if let Some(r) = remote {
        r.fetch_outputs(&config.telemetry.output);
    }
    if let Some(dest) = &config.telemetry.timeline_path {
        match telemetry::merge_rank_timelines(&config.telemetry.output, n, dest) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("warning: merging the timeline: {e:#}"),
        }
    }
}

/// The program and its arguments as text (for logs and ssh command lines).
fn program_words(program: &[OsString]) -> Result<Vec<String>> {
    program
        .iter()
        .map(|w| {
            w.to_str()
                .map(str::to_owned)
                .with_context(|| format!("{w:?} is not valid UTF-8"))
        })
        .collect()
}

/// Where the ranks meet. `MASTER_PORT` is the program's: a program that meets its peers by
/// itself (torch's `init_process_group`) binds it in rank 0, as under torchrun, so for a local
/// job the launcher leaves it free (`--master-port`, else a port the system picks now) and
/// Flotilla's own ranks meet at the socket the launcher binds and rank 0 inherits, a port of
/// its own that they read from `FLOTILLA_COMM__MASTER_PORT` (which wins over
/// `MASTER_PORT`). Ranks on other hosts meet as [`crate::rendezvous_socket::for_job`] says.
fn ports(
    config: &mut TrainConfig,
    args: &LaunchArgs,
    local: bool,
) -> Result<(
    Option<crate::rendezvous_socket::RendezvousSocket>,
    Option<u16>,
)> {
    if !local {
        let socket = crate::rendezvous_socket::for_job(config, &args.run, false)?;
        return Ok((socket, None));
    }
    let program_port = match args.run.given("master-port") {
        true => config.comm.master_port,
        false => crate::rendezvous_socket::free_port(&config.comm.master_addr)?,
    };
    // Flotilla's own socket, bound as a config job's is, at a port the system picks.
    config.comm.master_port = 0;
    let socket = crate::rendezvous_socket::for_job(config, &args.run, true)?;
    Ok((socket, Some(program_port)))
}

/// Each rank's environment: its place in the job (of `n` ranks), the rendezvous (the
/// program's own `MASTER_PORT` when it has one, [`ports`]), the per-rank thread count
/// (unless the caller set one), the deadline, and where the secret and TLS files are.
/// The keys a program's ranks get in variables of their own: the world size and the
/// rendezvous address as torchrun's, the secret and TLS files as theirs; the inventory and
/// the launcher's TLS are the launcher's.
const PASSED_OTHERWISE: &[&str] = &[
    "topology.world_size",
    "topology.inventory",
    "comm.master_addr",
    "comm.master_port",
    "comm.secret_file",
    "comm.tls",
    "comm.auto_tls",
];

fn rank_env(
    config: &TrainConfig,
    (n, program_port): (usize, Option<u16>),
    threads: usize,
    tls: Option<TlsFiles>,
    secret_file: Option<std::path::PathBuf>,
) -> Result<impl Fn(usize) -> Vec<(String, String)> + use<>> {
    let threads = threads.max(1).to_string();
    let mut common: Vec<(String, String)> =
        ["RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"]
            .iter()
            .map(|k| {
                (
                    k.to_string(),
                    std::env::var(k).unwrap_or_else(|_| threads.clone()),
                )
            })
            .collect();
    let comm = &config.comm;
    common.extend([
        ("WORLD_SIZE".to_string(), n.to_string()),
        ("MASTER_ADDR".to_string(), comm.master_addr.clone()),
        (
            "MASTER_PORT".to_string(),
            program_port.unwrap_or(comm.master_port).to_string(),
        ),
    ]);
    if program_port.is_some() {
        let ours = keys::env_name("comm.master_port");
        common.push((ours, comm.master_port.to_string()));
    }
    // Every other setting the launcher was given, in the schema's own names.
    common.extend(config.settings_env(PASSED_OTHERWISE));
    common.extend(launch::burn_device_env(config));
    if let Some(path) = secret_file {
        let path = std::path::absolute(&path)
            .with_context(|| format!("making {} absolute", path.display()))?;
        common.push((SECRET_FILE_ENV.to_string(), path.display().to_string()));
    }
    if let Some(t) = tls {
        for (var, path) in [
            (TLS_CA_ENV, t.ca),
            (TLS_CERT_ENV, t.cert),
            (TLS_KEY_ENV, t.key),
        ] {
            common.push((var.to_string(), path.display().to_string()));
        }
    }
    Ok(move |rank: usize| {
        let mut env = vec![("RANK".to_string(), rank.to_string())];
        env.extend(common.iter().cloned());
        env
    })
}
