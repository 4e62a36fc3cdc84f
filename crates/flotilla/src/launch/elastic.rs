//! `flotilla launch -n MIN:MAX`: an elastic job on this host. The launcher keeps the job's
//! membership (a [`Lighthouse`] on the rendezvous port, so that no rank's loss — rank 0's
//! included — ends the job), starts MAX processes, each named by a slot
//! ([`flotilla_train::elastic::SLOT_ENV`]), and supervises them: a process that fails is
//! left out by the survivors, who train on, and (with `--max-restarts K`) replaced, at most
//! K times, by a new process under a new slot that joins at a step boundary. Fewer than
//! MIN ranks ends the job at once, naming the lost.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use flotilla_tcp::{Lighthouse, LighthouseConfig, LighthouseEvent};
use flotilla_train::TrainConfig;
use flotilla_train::elastic::SLOT_ENV;

use crate::job_secret::JobSecret;
use crate::launch::{FailWhen, LocalJob, Respawn};
use crate::rendezvous_socket::RendezvousSocket;

/// Each process's command by its index, with more environment variables (its slot).
pub(crate) type SlotCommand = Box<dyn Fn(usize, &[(String, String)]) -> Result<Command> + Send>;

/// What an elastic start needs from the launch.
pub(crate) struct Start<'a> {
    pub config: &'a TrainConfig,
    /// Each process's command and environment, by its index, with `vars` (its slot) added
    /// to its environment: `flotilla train CONFIG` or the user's program (`flotilla launch
    /// -n MIN:MAX -- PROGRAM`), here or over ssh on an inventory's host.
    pub command: SlotCommand,
    /// Ends the processes where they run when the job ends early (the inventory's hosts').
    pub stop: Option<crate::launch::StopHook>,
    /// The lighthouse's TLS when not the config's (an inventory job's made CA).
    pub tls: Option<flotilla_tcp::TlsConfig>,
    /// What a process started by hand runs to join the job (said when it can grow).
    pub join_with: String,
    pub socket: RendezvousSocket,
    pub secret: &'a JobSecret,
    /// Replacements allowed (`--max-restarts`).
    pub restarts: u32,
    /// Processes to start now (`--start-ranks`; `None`: MAX).
    pub start: Option<usize>,
}

/// Starts the lighthouse and MAX processes; the job fails when the lighthouse says it
/// cannot go on (fewer than MIN members).
pub(crate) fn start(s: Start<'_>) -> Result<LocalJob> {
    let c = s.config;
    let max = c.topology.world_size;
    let min = c.topology.min_world_size.unwrap_or(max);
    let first = s.start.unwrap_or(max);
    if first < min || first > max {
        anyhow::bail!("--start-ranks {first}: an elastic job of {min}:{max} starts {min} to {max}");
    }
    let mut config = lighthouse_config(c, s.secret, first)?;
    if s.tls.is_some() {
        config.tls = s.tls;
    }
    let lighthouse = Lighthouse::start(config, s.socket.into_listener())?;
    println!(
        "[launcher] elastic job: {min} to {max} ranks; the launcher keeps the membership \
         (lighthouse on port {}){}",
        lighthouse.port(),
        if s.restarts > 0 {
            format!("; a failed rank is replaced, at most {} times", s.restarts)
        } else {
            String::new()
        }
    );
    let base = s.command;
    let command =
        move |index: usize, slot: usize| base(index, &[(SLOT_ENV.into(), slot.to_string())]);
    if first < max {
        println!(
            "[launcher] more ranks join this job (up to {max}) with: {SLOT_ENV}=<a number of \
             your own, from 1000> MASTER_ADDR={} {}={}{} and this job's secret: {}",
            c.comm.master_addr,
            flotilla_train::config::keys::env_name("comm.master_port"),
            lighthouse.port(),
            crate::launch::burn_device_env(c).map_or(String::new(), |(k, v)| format!(" {k}={v}")),
            s.join_with
        );
    }
    let commands = (0..first)
        .map(|i| command(i, i))
        .collect::<Result<Vec<_>>>()?;
    let mut job = LocalJob::start(commands, s.stop)?;
    // No process is needed by name: the survivors go on without a lost one.
    job.tolerate(0..first);
    let mut next_slot = first;
    let ending = Arc::new(AtomicBool::new(false));
    job.respawn_with(Respawn {
        make: Box::new(move |index| {
            next_slot += 1;
            command(index, next_slot - 1)
        }),
        ranks: (0..first).collect(),
        left: s.restarts,
        total: s.restarts,
        used: 0,
        ending: Some(ending.clone()),
    });
    job.fail_when(watch(lighthouse, ending));
    Ok(job)
}

/// The lighthouse of an elastic job of `c` that starts with `first` processes.
fn lighthouse_config(
    c: &TrainConfig,
    secret: &JobSecret,
    first: usize,
) -> Result<LighthouseConfig> {
    let max = c.topology.world_size;
    let timeout = Duration::try_from_secs_f64(c.comm.timeout_s).context("comm.timeout_s")?;
    Ok(LighthouseConfig {
        min: c.topology.min_world_size.unwrap_or(max),
        max,
        first,
        secret: secret.secret().cloned(),
        tls: c.tls()?,
        insecure: c.comm.insecure,
        join_timeout: Duration::try_from_secs_f64(c.comm.join_timeout_s)
            .context("comm.join_timeout_s")?,
        // A member that has not enlisted again within the job's deadline is left out.
        agreement: timeout,
        timeout,
        unit: c.elastic_unit(),
    })
}

/// What the launcher does with the lighthouse's news: says each generation, stops
/// replacing processes once the job is ending (`ending`), and ends the job below the
/// minimum.
fn watch(lighthouse: Lighthouse, ending: Arc<AtomicBool>) -> FailWhen {
    Box::new(move || match lighthouse.try_event()? {
        LighthouseEvent::Running { generation, slots } => {
            println!("[launcher] generation {generation}: slots {slots:?} (by rank)");
            None
        }
        LighthouseEvent::Finished => {
            ending.store(true, Ordering::SeqCst);
            None
        }
        LighthouseEvent::Failed(re) => Some(format!("the elastic job cannot go on: {re}")),
    })
}
