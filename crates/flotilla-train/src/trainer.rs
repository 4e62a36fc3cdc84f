//! How a rank's run ended ([`RunSummary`]), the lines a rank logs about itself, and the
//! report every rank sends rank 0 at the end.

use std::path::PathBuf;
use std::time::Instant;

use crate::error::Result;
use crate::history::{History, RankReport};
use crate::runloop;
use crate::strategy::{Cx, Strategy};

/// What a rank does, in a word (its strategy's name, before the strategy is built).
pub use crate::strategy::registry::role_label;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// This process's role (`peer` for all-reduce, `root`, `local-server`, `worker`).
    pub role: &'static str,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Final test accuracy.
    pub test_acc: f64,
    /// Final test loss (a text's validation loss, in nats per token).
    pub test_loss: f64,
    /// The final test loss in bits per byte, when the tokens are bytes (a text).
    pub bpb: Option<f64>,
    /// Mean global training loss of the last epoch.
    pub train_loss: f64,
    /// Optimizer steps taken (in total, including those before a resume).
    pub steps: u64,
    /// The step (or round) this process started from: a resumed checkpoint's, else 0.
    pub resumed_at: u64,
    /// Steps (or rounds) this process itself took, counted as they finished: a run resumed
    /// at step `r` of `n` takes `n - r`.
    pub steps_run: u64,
    /// Seconds from start to end.
    pub wall_s: f64,
    /// Global training samples per second over the run.
    pub samples_per_s: f64,
    /// Global training samples of this run (as this rank counts them: peers and the root
    /// count every rank's).
    pub samples: u64,
    /// XXH3 of the final parameters (identical on every rank).
    pub param_hash: u64,
    /// The final checkpoint directory (rank 0 only).
    pub checkpoint: Option<PathBuf>,
    /// The figures above by name, and the role's own (see [`crate::strategy::Strategy::figures`]).
    pub figures: std::collections::BTreeMap<String, f64>,
    /// This rank's history of the run (losses, epoch ends, evaluations).
    pub history: History,
    /// Every rank's role, figures and traffic, by rank, gathered at the end of the run;
    /// `None` when a rank could not take part (e.g. a worker an async server lost).
    pub ranks: Option<Vec<RankReport>>,
}

impl RunSummary {
    /// The stable, parseable last line of a run. Roles that do not evaluate (local servers,
    /// workers) say what they did instead.
    pub fn final_line(&self) -> String {
        match self.role {
            "peer" | "root" | "stage" => {
                // A text's validation loss, in nats and bits per byte.
                let text = self.bpb.map_or(String::new(), |b| {
                    format!(" val_loss={:.4} bpb={b:.4}", self.test_loss)
                });
                format!(
                    "final test_acc={:.4} loss={:.4}{text} steps={} wall_s={:.1}",
                    self.test_acc, self.test_loss, self.steps, self.wall_s
                )
            }
            role => format!(
                "final role={role} rank={} rounds={} train_loss={:.4} wall_s={:.1}",
                self.rank, self.steps, self.train_loss, self.wall_s
            ),
        }
    }
}

/// The line a rank logs once it joined: rank, model, device (what it resolved to: the
/// adapter, or what `auto` chose and why), config hash and the launcher's local rank (rank
/// among this host's processes), when it gave one.
pub(crate) fn up_line(
    device: &str,
    model: &str,
    (rank, world): (usize, usize),
    hash: u64,
) -> String {
    let local = flotilla_cluster::LauncherEnv::from_process()
        .ok()
        .and_then(|e| e.local_rank)
        .map_or(String::new(), |l| {
            format!(" local_rank={} (${})", l.value, l.var)
        });
    format!("rank {rank}/{world} up: model={model} device={device} config_hash={hash:016x}{local}")
}

/// The line a rank logs at the end of its run saying where its parameter tensors are, as
/// the tensors themselves report it ([`flotilla_engine::ModelState::param_placement`], not the
/// configured device): `rank 1 (worker) parameter tensors on wgpu (Cpu on Vulkan) (all 10
/// parameter tensors)`. One mechanism for every role, through [`Strategy::model`]: a peer's,
/// a worker's and a server's engine, a pipeline stage's part of the model; a role that holds
/// no model of its own (a local server relays its parent's as flat host buffers) says so.
/// Tensors on two devices are an error.
pub(crate) fn placement_line(strategy: &mut dyn Strategy, rank: usize) -> Result<String> {
    let role = strategy.name();
    let what = match strategy.model() {
        Some(model) => match model.param_placement()? {
            Some(placement) => format!("on {placement}"),
            None => "none (no layer of its part has parameters)".to_string(),
        },
        None => "none (it holds no model of its own)".to_string(),
    };
    Ok(format!("rank {rank} ({role}) parameter tensors {what}"))
}

/// This rank's summary of a finished run (`started`: when the process started), with every
/// rank's report on rank 0.
pub(crate) fn summary(
    role: &dyn Strategy,
    cx: &mut Cx<'_>,
    done: runloop::Finished,
    started: Instant,
) -> RunSummary {
    let (data_wait_s, data_bytes) = (done.data_wait_s, done.data_bytes);
    let steps_peak = done.steps_peak_resident_bytes;
    let mut s = bare_summary(role, cx, done, started);
    let own = role.figures(cx);
    s.figures = [
        ("test_acc", s.test_acc),
        ("test_loss", s.test_loss),
        ("val_loss", s.bpb.map_or(f64::NAN, |_| s.test_loss)),
        ("bpb", s.bpb.unwrap_or(f64::NAN)),
        ("train_loss", s.train_loss),
        ("steps", s.steps as f64),
        ("resumed_at", s.resumed_at as f64),
        ("steps_run", s.steps_run as f64),
        ("wall_s", s.wall_s),
        ("samples_per_s", s.samples_per_s),
        ("data_wait_s", data_wait_s.unwrap_or(f64::NAN)),
        ("data_bytes", data_bytes as f64),
        (
            "peak_resident_bytes",
            crate::resident::peak_resident_bytes().unwrap_or(f64::NAN),
        ),
        ("steps_peak_resident_bytes", steps_peak.unwrap_or(f64::NAN)),
    ]
    .into_iter()
    .chain(own)
    .filter(|(_, v)| v.is_finite())
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    s.ranks = gather_ranks(&s, cx);
    s
}

/// Every rank's [`RankReport`], sent to rank 0 once at the end (the traffic of the
/// exchange itself is not counted; other ranks get `None`). A missing report is logged,
/// not fatal: the run itself is done.
fn gather_ranks(s: &RunSummary, cx: &mut Cx<'_>) -> Option<Vec<RankReport>> {
    let traffic = cx.comm.stats();
    let mine = RankReport {
        rank: s.rank,
        role: s.role.to_string(),
        bytes_sent: traffic.bytes_sent,
        bytes_received: traffic.bytes_received,
        shm_bytes: traffic.shm_bytes,
        bytes_sent_inter_host: traffic.bytes_sent_inter_host,
        figures: s.figures.clone(),
    };
    let timeout = std::time::Duration::from_secs_f64(cx.config.comm.timeout_s);
    let gathered = crate::gather::to_root(&**cx.comm, mine, timeout)?;
    for (rank, why) in &gathered.missing {
        // The log is the place for it; a failed write of it changes nothing here.
        let _ = cx.log(&format!(
            "warning: no end-of-run report from rank {rank} (its traffic is not in the summary): {why}"
        ));
    }
    Some(gathered.reports)
}

fn bare_summary(
    role: &dyn Strategy,
    cx: &Cx<'_>,
    done: runloop::Finished,
    started: Instant,
) -> RunSummary {
    RunSummary {
        role: role.name(),
        rank: cx.rank,
        world_size: cx.comm.size(),
        test_acc: done.eval.map_or(f64::NAN, |e| e.accuracy()),
        test_loss: done.eval.map_or(f64::NAN, |e| e.loss()),
        bpb: done
            .eval
            .and_then(|e| crate::eval::bits_per_byte(&e, cx.test)),
        train_loss: done.train_loss,
        steps: done.progress,
        resumed_at: done.resumed_at,
        steps_run: done.steps_run,
        wall_s: started.elapsed().as_secs_f64(),
        samples_per_s: done.samples_per_s,
        samples: done.samples,
        param_hash: done.param_hash.unwrap_or(0),
        checkpoint: done.checkpoint,
        figures: Default::default(),
        history: done.history,
        ranks: None,
    }
}
