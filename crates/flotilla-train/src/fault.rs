//! Fault injection for reliability tests: `FLOTILLA_FAULT=rank=R,step=S,action=A` makes rank
//! `R` misbehave after its step (or round) `S`:
//! - `exit`: exit with code 3 (a dead rank);
//! - `hang`: stop responding (a stuck rank);
//! - `bad_len`: a parameter-server worker pushes a gradient of the wrong length once (its
//!   server refuses it for good, and the worker stops naming why);
//! - `perturb`: add 0.001 to the rank's first parameter (ranks no longer agree, which the
//!   end-of-run check must name);
//! - `withhold`: an async all-reduce peer stops submitting its last parameter's gradient
//!   from that step on (the other ranks wait for it: the stall inspector must name it).

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Exit with code 3.
    Exit,
    /// Sleep for an hour.
    Hang,
    /// Push a gradient of the wrong length.
    BadLength,
    /// Change one parameter on this rank only.
    Perturb,
    /// Stop submitting one tensor (async all-reduce).
    Withhold,
}

/// A fault planned for this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    step: u64,
    action: FaultAction,
}

impl Fault {
    /// The fault `FLOTILLA_FAULT` plans for `rank`, if any.
    pub fn from_env(rank: usize) -> Option<Self> {
        Self::parse(&std::env::var("FLOTILLA_FAULT").ok()?, rank)
    }

    /// Parses a fault spec for `rank`.
    pub fn parse(spec: &str, rank: usize) -> Option<Self> {
        let (mut fault_rank, mut step, mut action) = (None, None, None);
        for part in spec.split(',') {
            match part.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
                Some(("rank", v)) => fault_rank = v.parse::<usize>().ok(),
                Some(("step", v)) => step = v.parse::<u64>().ok(),
                Some(("action", "exit")) => action = Some(FaultAction::Exit),
                Some(("action", "hang")) => action = Some(FaultAction::Hang),
                Some(("action", "bad_len")) => action = Some(FaultAction::BadLength),
                Some(("action", "perturb")) => action = Some(FaultAction::Perturb),
                Some(("action", "withhold")) => action = Some(FaultAction::Withhold),
                _ => {}
            }
        }
        (fault_rank? == rank).then_some(Fault {
            step: step?,
            action: action?,
        })
    }

    /// Whether this is a `withhold` fault due at or before `step`.
    pub fn withholds_at(&self, step: u64) -> bool {
        self.action == FaultAction::Withhold && step >= self.step
    }

    /// The action due at `step`, if any. `Exit` and `Hang` are carried out here and never
    /// return.
    pub fn at(&self, step: u64) -> Option<FaultAction> {
        if step != self.step {
            return None;
        }
        match self.action {
            FaultAction::Hang => {
                eprintln!("FLOTILLA_FAULT: rank stops responding after step {step}");
                std::thread::sleep(std::time::Duration::from_secs(3600));
                std::process::exit(3);
            }
            FaultAction::Exit => {
                eprintln!("FLOTILLA_FAULT: rank exits after step {step}");
                std::process::exit(3);
            }
            other => Some(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_for_its_rank() {
        let f = Fault::parse("rank=2,step=5,action=bad_len", 2).expect("fault");
        assert_eq!(f.at(4), None);
        assert_eq!(f.at(5), Some(FaultAction::BadLength));
        assert!(Fault::parse("rank=2,step=5,action=exit", 1).is_none());
        assert!(Fault::parse("rank=2,action=exit", 2).is_none());
        assert!(Fault::parse("rank=2,step=1,action=explode", 2).is_none());
        let p = Fault::parse("rank=0,step=3,action=perturb", 0).expect("perturb");
        assert_eq!(p.at(3), Some(FaultAction::Perturb));
    }
}
