//! Process-group semantics: sub-groups, tagged point-to-point, `recv_any`, integer
//! reductions. Every test runs on an in-memory world (threads of this process) and the
//! TCP ones also over 127.0.0.1, so both transports are held to the same behaviour.

// Only the world of ranks is used here; the rest of `common` serves the all-reduce tests.
#[allow(dead_code)]
mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::ok;
use flotilla_tcp::{
    CommConfig, CommError, ProcessGroup, ReduceOp, StallPolicy, StallWatcher, TcpGroup,
};

fn cfg(n: usize) -> CommConfig {
    CommConfig::new(Some(0), n)
        .with_timeout(Duration::from_secs(5))
        .with_join_timeout(Duration::from_secs(10))
        .with_chunk_bytes(4096)
}

/// Runs `body` on every rank of an `n`-rank world (`tcp`: over loopback, else in memory),
/// returning each rank's result in rank order.
fn world<T, F>(n: usize, tcp: bool, body: F) -> Vec<Result<T, CommError>>
where
    T: Send + 'static,
    F: Fn(TcpGroup) -> Result<T, CommError> + Send + Sync + 'static,
{
    common::world(n, tcp, cfg(n), body)
}

fn value(world_rank: usize, i: usize) -> f32 {
    ((world_rank * 7919 + i * 31) % 1000) as f32 * 0.25 - 50.0
}

/// Split {0,2} / {1,3}: each group sums only its own members' buffers (exactly: small
/// integers in f32), and a world all-reduce afterwards still sees all four.
fn sub_group_all_reduce(tcp: bool) {
    let len = 10_007;
    let res = ok(world(4, tcp, move |c| {
        let me = c.rank();
        let sub = c.split(Some((me % 2) as u32), me as i64)?.expect("member");
        let mut buf: Vec<f32> = (0..len).map(|i| value(me, i)).collect();
        // Interleave: a world collective between sub-group ones must not mix with them.
        let mut world_sum = vec![me as f32; 3];
        let p = sub.all_reduce_start(buf.clone());
        c.all_reduce_sum(&mut world_sum)?;
        sub.all_reduce_sum(&mut buf)?;
        let first = p.wait()?;
        Ok((sub.rank(), sub.size(), buf, first, world_sum))
    }));
    for (r, (sub_rank, sub_size, buf, first, world_sum)) in res.into_iter().enumerate() {
        assert_eq!((sub_rank, sub_size), (r / 2, 2), "rank {r}");
        let peer = r ^ 2; // the other member of its group: 0<->2, 1<->3
        for i in 0..len {
            let want = value(r, i) + value(peer, i);
            assert_eq!(first[i], want, "rank {r} elem {i}");
            assert_eq!(buf[i], want, "rank {r} elem {i}");
        }
        assert_eq!(world_sum, vec![6.0; 3]);
    }
}

#[test]
fn sub_group_all_reduce_in_memory() {
    sub_group_all_reduce(false);
}

#[test]
fn sub_group_all_reduce_over_tcp() {
    sub_group_all_reduce(true);
}

#[test]
fn group_of_ranks_and_nested_split() {
    let res = ok(world(4, false, |c| {
        let me = c.rank();
        // Ranks 3, 1 (in that order) form a group; 0 and 2 do not call it.
        let g = if me == 1 || me == 3 {
            let g = c.group(&[3, 1])?;
            let mut v = [g.rank() as f32 + 1.0];
            g.all_reduce_sum(&mut v)?;
            Some((g.rank(), g.world_rank(0), v[0]))
        } else {
            None
        };
        // A split where rank 2 opts out, then a split of the sub-group.
        let color = if me == 2 { None } else { Some(0) };
        let sub = c.split(color, -(me as i64))?;
        let nested = match &sub {
            Some(s) => {
                let inner = s.split(Some(0), 0)?.expect("member");
                Some((s.rank(), inner.all_gather_u64(me as u64)?))
            }
            None => None,
        };
        Ok((g, nested))
    }));
    assert_eq!(res[3].0, Some((0, 3, 3.0)));
    assert_eq!(res[1].0, Some((1, 3, 3.0)));
    assert_eq!(res[0].0, None);
    // Key -rank orders the split group 3, 1, 0.
    assert_eq!(res[3].1, Some((0, vec![3, 1, 0])));
    assert_eq!(res[0].1, Some((2, vec![3, 1, 0])));
    assert_eq!(res[2].1, None);
}

#[test]
fn group_arguments_are_checked() {
    let res = world(2, false, |c| {
        let outside = c.group(&[1 - c.rank()]).map(|_| ());
        let twice = c.group(&[0, 0]).map(|_| ());
        let range = c.group(&[0, 5]).map(|_| ());
        Ok((outside, twice, range))
    });
    for r in ok(res) {
        for e in [r.0, r.1, r.2] {
            assert!(matches!(e, Err(CommError::InvalidArgument(_))), "{e:?}");
        }
    }
}

fn tags_never_mix(tcp: bool) {
    let res = ok(world(2, tcp, |c| {
        let deadline = Instant::now() + Duration::from_secs(5);
        if c.rank() == 0 {
            for i in 0..5u8 {
                c.send(1, 10, &[i])?;
                c.send(1, 20, &[100 + i])?;
            }
            c.send(1, 30, b"last")?;
            Ok(Vec::new())
        } else {
            // Ask for tag 30 first: the ten earlier messages stay queued under their tags.
            let mut got = vec![c.recv(0, 30, deadline)?];
            for _ in 0..5 {
                got.push(c.recv(0, 20, deadline)?);
            }
            for _ in 0..5 {
                got.push(c.recv(0, 10, deadline)?);
            }
            Ok(got)
        }
    }));
    let want: Vec<Vec<u8>> = std::iter::once(b"last".to_vec())
        .chain((0..5).map(|i| vec![100 + i]))
        .chain((0..5).map(|i| vec![i]))
        .collect();
    assert_eq!(res[1], want);
}

/// A message larger than a frame may be (`max_frame_bytes`, here 64 MiB by default) goes
/// through `send_large` in pieces and arrives whole, beside an ordinary one; read from a
/// file's reader (`send_large_from`) it goes in pieces of at most 1 MiB, each handed to the
/// receiver's sink as it arrives (`recv_large_with`), and the same bytes arrive.
fn a_large_message_arrives_whole(tcp: bool) {
    let len = 2 * flotilla_tcp::LARGE_MESSAGE_PIECE + 12_345;
    let body: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let sent = body.clone();
    let res = ok(world(2, tcp, move |c| {
        let deadline = Instant::now() + Duration::from_secs(20);
        if c.rank() == 0 {
            c.send_large(1, 40, &sent)?;
            c.send(1, 41, b"after")?;
            c.send_large(1, 40, &[])?;
            let mut file = std::io::Cursor::new(&sent);
            c.send_large_from(1, 42, &mut file, sent.len() as u64)?;
            Ok((Vec::new(), Vec::new(), Vec::new(), Vec::new()))
        } else {
            let after = c.recv(0, 41, deadline)?;
            let big = c.recv_large(0, 40, deadline)?;
            let empty = c.recv_large(0, 40, deadline)?;
            let (mut streamed, mut largest) = (Vec::new(), 0);
            c.recv_large_with(0, 42, deadline, &mut |piece| {
                largest = largest.max(piece.len());
                streamed.extend_from_slice(piece);
                Ok(())
            })?;
            Ok((
                big,
                after,
                empty,
                [streamed, largest.to_le_bytes().to_vec()].concat(),
            ))
        }
    }));
    assert!(res[1].0 == body, "the large message arrived whole");
    assert_eq!(res[1].1, b"after");
    assert!(res[1].2.is_empty(), "an empty one too");
    let (streamed, largest) = res[1].3.split_at(len);
    assert!(streamed == body, "the file's bytes arrived as they were");
    let largest = usize::from_le_bytes(largest.try_into().expect("a usize"));
    assert!(largest <= 1 << 20, "a piece of {largest} bytes");
}

#[test]
fn a_large_message_arrives_whole_in_memory() {
    a_large_message_arrives_whole(false);
}

#[test]
fn a_large_message_arrives_whole_over_tcp() {
    a_large_message_arrives_whole(true);
}

#[test]
fn tags_never_mix_in_memory() {
    tags_never_mix(false);
}

#[test]
fn tags_never_mix_over_tcp() {
    tags_never_mix(true);
}

#[test]
fn sub_group_messages_stay_in_their_group() {
    let res = ok(world(2, false, |c| {
        let sub = c.group(&[0, 1])?;
        let deadline = Instant::now() + Duration::from_secs(5);
        if c.rank() == 0 {
            sub.send(1, 1, b"sub")?;
            c.send(1, 1, b"world")?;
            Ok(Vec::new())
        } else {
            let w = c.recv(0, 1, deadline)?;
            let s = sub.recv(0, 1, deadline)?;
            Ok(vec![w, s])
        }
    }));
    assert_eq!(res[1], vec![b"world".to_vec(), b"sub".to_vec()]);
}

fn recv_any_first_speaker_and_deadline(tcp: bool) {
    let res = world(4, tcp, |c| {
        let me = c.rank();
        if me == 0 {
            let t = Instant::now();
            let first = c.recv_any(&[1, 2, 3], 5, t + Duration::from_secs(5))?;
            // Rank 2 sent its second message; rank 1 and 3 stay silent on tag 5.
            let second = c.recv_any(&[1, 2, 3], 5, t + Duration::from_secs(5))?;
            let silent = c.recv_any(&[1, 3], 5, Instant::now() + Duration::from_millis(300));
            c.barrier()?;
            Ok((Some(first), Some(second), Some(silent.map(|_| ()))))
        } else {
            if me == 2 {
                c.send(0, 5, b"two-a")?;
                c.send(0, 5, b"two-b")?;
            }
            c.barrier()?;
            Ok((None, None, None))
        }
    });
    let r0 = ok(res).remove(0);
    assert_eq!(r0.0, Some((2, b"two-a".to_vec())));
    assert_eq!(r0.1, Some((2, b"two-b".to_vec())));
    match r0.2 {
        Some(Err(e @ CommError::Deadline { .. })) => {
            let msg = e.to_string();
            assert!(msg.contains("rank(s) 1, 3"), "{msg}");
        }
        other => panic!("expected a deadline naming 1 and 3, got {other:?}"),
    }
}

#[test]
fn recv_any_returns_the_first_speaker_and_names_the_silent_in_memory() {
    recv_any_first_speaker_and_deadline(false);
}

#[test]
fn recv_any_returns_the_first_speaker_and_names_the_silent_over_tcp() {
    recv_any_first_speaker_and_deadline(true);
}

#[test]
fn recv_any_reports_a_lost_peer_after_its_queued_messages() {
    let res = world(3, false, |c| {
        let me = c.rank();
        let deadline = Instant::now() + Duration::from_secs(5);
        match me {
            2 => {
                c.send(0, 1, b"bye")?;
                drop(c); // the process "dies"
                Ok(Vec::new())
            }
            1 => {
                // Stays alive until rank 0 is done.
                c.recv(0, 9, deadline)?;
                Ok(Vec::new())
            }
            _ => {
                let (from, m) = c.recv_any(&[1, 2], 1, deadline)?;
                let lost = c.recv_any(&[1, 2], 1, deadline);
                c.send(1, 9, b"done")?;
                let lost = match lost {
                    Err(e) => format!("{:?} {e}", e.blamed_rank()),
                    Ok(x) => format!("unexpected {x:?}"),
                };
                Ok(vec![
                    format!("{from} {}", String::from_utf8_lossy(&m)),
                    lost,
                ])
            }
        }
    });
    let r0 = ok(res).remove(0);
    assert_eq!(r0[0], "2 bye");
    assert!(
        r0[1].starts_with("Some(2) connection to rank 2 lost"),
        "{}",
        r0[1]
    );
}

fn integer_reductions(tcp: bool) {
    let res = ok(world(3, tcp, |c| {
        let me = c.rank() as i64;
        let mut mx = [me, -me, 10 * me];
        c.all_reduce_i64(&mut mx, ReduceOp::Max)?;
        let mut mn = [me, -me, 10 * me];
        c.all_reduce_i64(&mut mn, ReduceOp::Min)?;
        let mut sum = [me, 1];
        c.all_reduce_i64(&mut sum, ReduceOp::Sum)?;
        // Bit sets: bit k set on rank r when k % (r + 1) == 0; word 1 all ones.
        let word: u64 = (0..64)
            .filter(|k| k % (me as u64 + 1) == 0)
            .map(|k| 1 << k)
            .sum();
        let mut and = [word, u64::MAX];
        c.all_reduce_u64(&mut and, ReduceOp::And)?;
        let mut or = [word, 0];
        c.all_reduce_u64(&mut or, ReduceOp::Or)?;
        Ok((mx, mn, sum, and, or))
    }));
    let every: u64 = (0..64).filter(|k| k % 6 == 0).map(|k| 1u64 << k).sum();
    for (mx, mn, sum, and, or) in res {
        assert_eq!(mx, [2, 0, 20]);
        assert_eq!(mn, [0, -2, 0]);
        assert_eq!(sum, [3, 3]);
        assert_eq!(and, [every, u64::MAX]);
        // Rank 0 sets every bit.
        assert_eq!(or, [u64::MAX, 0]);
    }
}

#[test]
fn integer_and_bit_set_reductions_in_memory() {
    integer_reductions(false);
}

#[test]
fn integer_and_bit_set_reductions_over_tcp() {
    integer_reductions(true);
}

#[test]
fn in_memory_world_names_a_stuck_rank() {
    // Rank 0 fails at its 5 s deadline (plus slack), not when rank 1 wakes up at 7 s.
    let res = world(2, false, |c| {
        if c.rank() == 1 {
            thread::sleep(Duration::from_secs(7));
            return Ok(None);
        }
        let t = Instant::now();
        let mut v = [1.0f32];
        let err = c.all_reduce_sum(&mut v).err();
        Ok(Some((t.elapsed(), err)))
    });
    let Ok(Some((took, err))) = &res[0] else {
        panic!("{:?}", res[0]);
    };
    match err {
        Some(e @ CommError::Timeout { peer: 1, .. }) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with("timed out after 5s waiting for rank 1 during"),
                "{msg}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        *took >= Duration::from_secs(5) && *took < Duration::from_secs(5 + 2),
        "{took:?}"
    );
}

#[test]
fn the_stall_inspector_stops_at_once_not_after_its_period() {
    // Its rounds are a second apart (a minute's warning): a run's end must not wait out the
    // rest of one (every run ended a second late before).
    let res = world(2, false, |c| {
        let c: std::sync::Arc<dyn ProcessGroup> = std::sync::Arc::new(c);
        let channel = c.group(&[0, 1])?;
        let policy = StallPolicy {
            warning: Duration::from_secs(60),
            shutdown: None,
        };
        let watcher = StallWatcher::start(c, channel, policy)?;
        // The first round is done and the inspector rests until its next.
        thread::sleep(Duration::from_millis(150));
        let t = Instant::now();
        watcher.shutdown()?;
        Ok(t.elapsed())
    });
    for (rank, took) in ok(res).into_iter().enumerate() {
        assert!(took < Duration::from_millis(400), "rank {rank}: {took:?}");
    }
}
