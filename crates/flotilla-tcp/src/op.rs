//! The context of one running collective: sends and receives its frames on the group's
//! queues, tagged and checked.

use std::sync::Arc;
use std::time::Duration;

use flotilla_group::CommError;

use crate::config::CommConfig;
use crate::conn::{Conn, Received};
use crate::frame::{Op, channel};
use crate::world::GroupState;

/// How long a failed send waits for the peer's abort notice (see `OpCtx::prefer_abort`).
const ABORT_GRACE: Duration = Duration::from_millis(500);

/// Context of one running collective: sends and receives frames tagged with its group and
/// sequence number and validates what arrives. Ranks are group ranks.
pub(crate) struct OpCtx<'a> {
    g: &'a GroupState,
    seq: u64,
    op: Op,
}

impl<'a> OpCtx<'a> {
    /// The context of collective `seq` (of kind `op`) of group `g`.
    pub(crate) fn new(g: &'a GroupState, seq: u64, op: Op) -> Self {
        Self { g, seq, op }
    }

    pub(crate) fn rank(&self) -> usize {
        self.g.me()
    }

    pub(crate) fn size(&self) -> usize {
        self.g.members.len()
    }

    pub(crate) fn cfg(&self) -> &CommConfig {
        &self.g.world.cfg
    }

    /// The world rank of group rank `peer` (what errors name).
    pub(crate) fn world_rank(&self, peer: usize) -> usize {
        self.g.members.world_rank(peer)
    }

    pub(crate) fn describe(&self) -> String {
        if self.g.key == 0 {
            format!("{} #{}", self.op.name(), self.seq)
        } else {
            format!(
                "{} #{} of group {:016x}",
                self.op.name(),
                self.seq,
                self.g.key
            )
        }
    }

    fn conn(&self, peer: usize) -> Result<Arc<Conn>, CommError> {
        self.g.world.collective_conn(self.world_rank(peer))
    }

    /// Sends one frame of this collective to group rank `peer`.
    pub(crate) async fn send(
        &self,
        peer: usize,
        tag: u32,
        payload: &[u8],
    ) -> Result<(), CommError> {
        let conn = self.conn(peer)?;
        let t = self.g.world.cfg.timeout;
        let header = (self.g.key, self.seq, tag);
        match tokio::time::timeout(t, conn.send(channel::COLLECTIVE, self.op, header, payload))
            .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self
                .prefer_abort(&conn, conn.send_error(&self.describe(), &e))
                .await),
            Err(_) => Err(CommError::Timeout {
                peer: conn.rank,
                op: self.describe(),
                after: t,
            }),
        }
    }

    /// A peer that aborted closes right after its notice, so a send to it can fail before
    /// this process has read the notice (which names the root cause, e.g. a rank lost on
    /// another host): waits, at most [`ABORT_GRACE`], until the connection's reader has
    /// read to the end (the notice comes before it), then prefers the notice to `e`.
    async fn prefer_abort(&self, conn: &Conn, e: CommError) -> CommError {
        let abort = &self.g.world.ep.abort;
        let read_out = async {
            while abort.borrow().is_none() && !conn.is_lost() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        let _ = tokio::time::timeout(ABORT_GRACE, read_out).await;
        match abort.borrow().clone() {
            Some((by, reason)) => CommError::Aborted { by, reason },
            None => e,
        }
    }

    /// Receives frame number `tag` of this collective from group rank `peer`, which must
    /// carry exactly `len` payload bytes (`None`: any length).
    pub(crate) async fn recv(
        &self,
        peer: usize,
        tag: u32,
        len: Option<usize>,
    ) -> Result<Received, CommError> {
        let conn = self.conn(peer)?;
        let world_peer = conn.rank;
        let t = self.g.world.cfg.timeout;
        let mut abort = self.g.world.ep.abort.subscribe();
        let got = tokio::select! {
            biased;
            f = conn.recv(self.g.key) => f,
            a = abort.wait_for(Option::is_some) => {
                let (by, reason) = a.ok().and_then(|v| v.clone()).unwrap_or((world_peer, "aborted".into()));
                return Err(CommError::Aborted { by, reason });
            }
            _ = tokio::time::sleep(t) => {
                return Err(CommError::Timeout { peer: world_peer, op: self.describe(), after: t });
            }
        };
        let Some(f) = got else {
            // A peer that aborted usually closes right after; its abort notice carries the
            // root cause, so prefer it over "connection lost".
            if let Some((by, reason)) = abort.borrow().clone() {
                return Err(CommError::Aborted { by, reason });
            }
            return Err(conn.group_lost_error(self.g.key, &self.describe()));
        };
        let h = &f.header;
        let len_ok = len.is_none_or(|l| f.payload.len() == l);
        if h.op != self.op as u8 || h.seq != self.seq || h.tag != tag || !len_ok {
            let got_op = Op::from_u8(h.op).map_or("unknown", Op::name);
            let want = len.map_or("any length".to_string(), |l| format!("{l} bytes"));
            return Err(CommError::Protocol {
                peer: world_peer,
                detail: format!(
                    "expected {} frame {tag} ({want}), got {got_op} #{} frame {} ({} bytes); \
                     ranks issued collectives in different orders or with different sizes",
                    self.describe(),
                    h.seq,
                    h.tag,
                    f.payload.len()
                ),
            });
        }
        Ok(f)
    }
}
