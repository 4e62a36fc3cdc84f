//! The setup of a group's segment, and the members' agreement on it, in the turn of the
//! group's first collective that needs it (frames on the group's TCP links, of that
//! collective's kind and sequence number):
//!
//! 1. rank 0 removes the files killed creators left in the directory
//!    ([`crate::segment::sweep`]), creates the segment there and offers its path to every
//!    member (or, when it could not create one, the reason);
//! 2. each member opens the path ([`Segment::open`]: no symbolic link, the header's layout
//!    checked against its own) and answers: mapped, unreachable (another `/dev/shm`, a
//!    private temporary directory: the segment is not shared with it) or made for another
//!    layout (the members' settings differ);
//! 3. rank 0 sends every member the verdict, and removes the file: the segment (all
//!    mapped), TCP (some member could not reach it: the group's `f32` collectives then
//!    go over its TCP links for good, with a warning naming the group and the reason; an
//!    error under `transport: shm`), or failure (a layout differs: an error on every rank).
//!
//! Every member follows rank 0's verdict, so no member runs on the segment while another
//! runs on TCP. Host keys ([`crate::host`]) already keep ranks that see different segment
//! directories apart; the verdict covers what a key cannot see (a segment created in the
//! temporary directory because `/dev/shm` is full, where the members' temporary
//! directories differ; a directory that cannot be opened).

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use flotilla_group::CommError;

use crate::config::Transport;
use crate::frame::Op;
use crate::op::OpCtx;
use crate::segment::{Layout, OpenError, Segment, file_name, sweep};
use crate::world::GroupState;

/// Frame tags of the setup: the offer (rank 0 to each), the answer (each to rank 0), the
/// verdict (rank 0 to each).
const TAG_OFFER: u32 = 0;
const TAG_ANSWER: u32 = 1;
const TAG_VERDICT: u32 = 2;

/// First byte of an offer: a path follows, or the reason there is no segment.
const OFFER_PATH: u8 = 0;
const OFFER_NONE: u8 = 1;
/// First byte of an answer (a reason follows the last two).
const ANSWER_MAPPED: u8 = 0;
const ANSWER_UNREACHABLE: u8 = 1;
const ANSWER_MISMATCH: u8 = 2;

/// What the group does with its segment, decided by its rank 0 for every member.
#[derive(Debug)]
enum Verdict {
    /// Every member mapped it.
    Use,
    /// Some member cannot reach it (why): the group's `f32` collectives go over TCP.
    Tcp(String),
    /// Some member's layout differs (why): every member fails.
    Fail(String),
}

impl Verdict {
    fn encode(&self) -> Vec<u8> {
        match self {
            Verdict::Use => vec![0],
            Verdict::Tcp(why) => message(1, why.as_bytes()),
            Verdict::Fail(why) => message(2, why.as_bytes()),
        }
    }

    fn decode(ctx: &OpCtx<'_>, payload: &[u8]) -> Result<Self, CommError> {
        let (kind, why) = split(ctx, payload)?;
        let why = String::from_utf8_lossy(why).into_owned();
        match kind {
            0 => Ok(Verdict::Use),
            1 => Ok(Verdict::Tcp(why)),
            2 => Ok(Verdict::Fail(why)),
            k => Err(malformed(ctx, 0, k)),
        }
    }
}

/// A setup message: its kind, then its bytes (a path or a reason).
fn message(kind: u8, rest: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(1 + rest.len());
    m.push(kind);
    m.extend_from_slice(rest);
    m
}

fn split<'p>(ctx: &OpCtx<'_>, payload: &'p [u8]) -> Result<(u8, &'p [u8]), CommError> {
    match payload.split_first() {
        Some((&kind, rest)) => Ok((kind, rest)),
        None => Err(CommError::Protocol {
            peer: ctx.world_rank(0),
            detail: format!("{}: an empty shared-memory setup message", ctx.describe()),
        }),
    }
}

fn malformed(ctx: &OpCtx<'_>, peer: usize, kind: u8) -> CommError {
    CommError::Protocol {
        peer: ctx.world_rank(peer),
        detail: format!(
            "{}: unknown shared-memory setup message {kind}",
            ctx.describe()
        ),
    }
}

/// The layout of group `g`'s segment under this rank's config.
fn layout(g: &GroupState) -> Layout {
    let cfg = &g.world.cfg;
    Layout::new(
        g.members.len(),
        cfg.shm_chunk_bytes,
        cfg.small_all_reduce_bytes,
    )
}

/// The directory for a new segment of `bytes`: the configured one, else `shm` (`/dev/shm`)
/// when it has room, else the system temporary directory.
pub(super) fn segment_dir(configured: Option<&Path>, shm: &Path, bytes: usize) -> PathBuf {
    if let Some(d) = configured {
        return d.to_path_buf();
    }
    match rustix::fs::statvfs(shm) {
        Ok(s) if s.f_bavail.saturating_mul(s.f_frsize) >= bytes as u64 => shm.to_path_buf(),
        _ => std::env::temp_dir(),
    }
}

/// Removes the segment's file when dropped (after every member answered, or on failure).
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Rank 0 creates the group's segment (falling back to the temporary directory when
/// `/dev/shm` turns out full), after sweeping the directory; `Err`: why it could not.
fn create(g: &GroupState, layout: &Layout) -> Result<(Segment, PathBuf), String> {
    let cfg = &g.world.cfg;
    let name = file_name(g.world.session, g.key);
    let in_dir = |dir: &Path| {
        sweep(dir);
        let path = dir.join(&name);
        let made = Segment::create(&path, layout, 0);
        (made, path)
    };
    let dir = segment_dir(
        cfg.shm_dir.as_deref(),
        Path::new("/dev/shm"),
        layout.bytes(),
    );
    let (mut made, mut path) = in_dir(&dir);
    let temp = std::env::temp_dir();
    if matches!(&made, Err(e) if e.kind() == io::ErrorKind::StorageFull)
        && cfg.shm_dir.is_none()
        && dir != temp
    {
        (made, path) = in_dir(&temp);
    }
    match made {
        Ok(seg) => Ok((seg, path)),
        Err(e) => Err(format!(
            "cannot create the shared-memory segment {}: {e}",
            path.display()
        )),
    }
}

/// Rank 0's side: creates the segment, offers it, gathers the answers and sends the
/// verdict; the file is removed on return.
async fn lead(ctx: &OpCtx<'_>, g: &GroupState) -> Result<(Verdict, Option<Segment>), CommError> {
    let n = ctx.size();
    let (seg, path) = match create(g, &layout(g)) {
        Ok(made) => made,
        Err(why) => {
            let offer = message(OFFER_NONE, why.as_bytes());
            for p in 1..n {
                ctx.send(p, TAG_OFFER, &offer).await?;
            }
            let why = format!("rank {}: {why}", ctx.world_rank(0));
            return Ok((Verdict::Tcp(why), None));
        }
    };
    let _unlink = Unlink(path.clone());
    let offer = message(OFFER_PATH, path.as_os_str().as_bytes());
    for p in 1..n {
        ctx.send(p, TAG_OFFER, &offer).await?;
    }
    let (mut unreachable, mut mismatch) = (Vec::new(), Vec::new());
    for p in 1..n {
        let answer = ctx.recv(p, TAG_ANSWER, None).await?;
        let (kind, why) = split(ctx, &answer.payload)?;
        let why = format!(
            "rank {}: {}",
            ctx.world_rank(p),
            String::from_utf8_lossy(why)
        );
        match kind {
            ANSWER_MAPPED => {}
            ANSWER_UNREACHABLE => unreachable.push(why),
            ANSWER_MISMATCH => mismatch.push(why),
            k => return Err(malformed(ctx, p, k)),
        }
    }
    let verdict = if !mismatch.is_empty() {
        Verdict::Fail(mismatch.join("; "))
    } else if !unreachable.is_empty() {
        Verdict::Tcp(unreachable.join("; "))
    } else {
        Verdict::Use
    };
    let sent = verdict.encode();
    for p in 1..n {
        ctx.send(p, TAG_VERDICT, &sent).await?;
    }
    tracing::debug!(path = %path.display(), members = n, ?verdict, "shared-memory segment offered");
    Ok((verdict, Some(seg)))
}

/// Another member's side: opens the segment rank 0 offers, answers, takes the verdict.
async fn follow(ctx: &OpCtx<'_>, g: &GroupState) -> Result<(Verdict, Option<Segment>), CommError> {
    let offer = ctx.recv(0, TAG_OFFER, None).await?;
    let (kind, rest) = split(ctx, &offer.payload)?;
    match kind {
        OFFER_PATH => {}
        OFFER_NONE => {
            let why = format!(
                "rank {}: {}",
                ctx.world_rank(0),
                String::from_utf8_lossy(rest)
            );
            return Ok((Verdict::Tcp(why), None));
        }
        k => return Err(malformed(ctx, 0, k)),
    }
    let path = PathBuf::from(OsStr::from_bytes(rest));
    let opened = Segment::open(&path, &layout(g), ctx.rank());
    let answer = match &opened {
        Ok(_) => message(ANSWER_MAPPED, &[]),
        Err(e @ OpenError::Unreachable { .. }) => {
            message(ANSWER_UNREACHABLE, e.to_string().as_bytes())
        }
        Err(e @ OpenError::Mismatch(_)) => message(ANSWER_MISMATCH, e.to_string().as_bytes()),
    };
    ctx.send(0, TAG_ANSWER, &answer).await?;
    let verdict = Verdict::decode(ctx, &ctx.recv(0, TAG_VERDICT, None).await?.payload)?;
    Ok((verdict, opened.ok()))
}

/// How the group is named in what the setup reports.
fn group_name(g: &GroupState) -> String {
    let ranks = g.members.world_ranks();
    if g.key == 0 {
        format!("the world group (ranks {ranks:?})")
    } else {
        format!("group {:016x} (world ranks {ranks:?})", g.key)
    }
}

/// Sets up group `g`'s segment in the turn of its collective `ticket` (of kind `op`), as
/// every member agrees: `Some` the segment, `None` the group's `f32` collectives go over
/// TCP (`transport: auto`, warned); an error when a layout differs, or when the segment
/// cannot be shared under `transport: shm`.
pub(super) async fn set_up(
    g: &GroupState,
    ticket: u64,
    op: Op,
) -> Result<Option<Segment>, CommError> {
    let ctx = OpCtx::new(g, ticket, op);
    let (verdict, seg) = if ctx.rank() == 0 {
        lead(&ctx, g).await?
    } else {
        follow(&ctx, g).await?
    };
    match (verdict, seg) {
        (Verdict::Use, Some(seg)) => Ok(Some(seg)),
        (Verdict::Use, None) => Err(CommError::Protocol {
            peer: ctx.world_rank(0),
            detail: format!(
                "{}: told to use a shared-memory segment this rank could not map",
                ctx.describe()
            ),
        }),
        (Verdict::Tcp(why), _) if g.world.cfg.transport == Transport::Shm => Err(CommError::io(
            format!(
                "transport shm: {} cannot share a segment (transport auto falls back to TCP)",
                group_name(g)
            ),
            io::Error::other(why),
        )),
        (Verdict::Tcp(why), _) => {
            tracing::warn!(
                group = %group_name(g),
                reason = %why,
                "the group's members cannot share a memory segment: its f32 collectives go over TCP"
            );
            Ok(None)
        }
        (Verdict::Fail(why), _) => Err(CommError::Config(format!(
            "the shared-memory segment of {}: {why}",
            group_name(g)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_falls_back_to_temp_when_dev_shm_is_small_or_missing() {
        let tmp = std::env::temp_dir();
        let configured = Path::new("/somewhere/else");
        assert_eq!(
            segment_dir(Some(configured), Path::new("/dev/shm"), 1),
            configured
        );
        // No file system has room for this segment; a missing /dev/shm has none either.
        assert_eq!(segment_dir(None, Path::new("/dev/shm"), usize::MAX), tmp);
        assert_eq!(segment_dir(None, Path::new("/no/dev/shm"), 1), tmp);
        if Path::new("/dev/shm").is_dir() {
            assert_eq!(
                segment_dir(None, Path::new("/dev/shm"), 4096),
                Path::new("/dev/shm")
            );
        }
    }
}
