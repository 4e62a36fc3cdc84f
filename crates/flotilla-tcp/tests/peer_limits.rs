//! What one peer can make another process hold is bounded (`CommConfig::max_queued_bytes`,
//! the groups a process does not know): two ranks over TCP (with a secret), rank 1 playing
//! the peer that floods rank 0.

#[allow(dead_code)] // the values and tolerances of the all-reduce tests
mod common;

use std::time::{Duration, Instant};

use flotilla_tcp::{CommConfig, CommError, ProcessGroup, Secret};

const LIMIT: usize = 4 << 20;

fn cfg() -> CommConfig {
    let mut c = CommConfig::new(Some(0), 2)
        .with_timeout(Duration::from_secs(10))
        .with_max_frame_bytes(1 << 20)
        .with_chunk_bytes(256 << 10)
        .with_max_queued_bytes(LIMIT);
    c.secret = Some(Secret::new(b"test-secret-0123456789".to_vec()).expect("secret"));
    c
}

/// This process's resident memory in bytes (`VmRSS`).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS");
    kb * 1024
}

fn soon(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

/// Rank 1 sends 192 MiB of point-to-point messages on fresh tags that rank 0 never
/// receives: rank 0's memory grows by far less than that (today it holds them all), a
/// receive from rank 1 then fails naming it and the limit, and the world's collectives go
/// on.
#[test]
fn a_flood_of_messages_on_fresh_tags_is_refused_and_memory_stays_bounded() {
    const MSG: usize = 64 << 10;
    const COUNT: u32 = 3072;
    let res = common::world(2, true, cfg(), |c| {
        c.barrier()?;
        let before = rss();
        if c.rank() == 1 {
            let msg = vec![5u8; MSG];
            for tag in 0..COUNT {
                c.send(0, tag, &msg)?;
            }
        }
        c.barrier()?;
        let grown = rss().saturating_sub(before);
        let got = (c.rank() == 0).then(|| c.recv(1, COUNT - 1, soon(5)));
        c.barrier()?;
        Ok((grown, got))
    });
    let (grown, got) = res
        .into_iter()
        .next()
        .expect("rank 0")
        .expect("rank 0's collectives go on");
    let flood = u64::from(COUNT) * MSG as u64;
    assert!(
        grown < flood / 4,
        "rank 0's memory grew by {grown} bytes during a flood of {flood}"
    );
    let e = got.expect("rank 0 receives").expect_err("refused");
    assert!(
        matches!(&e, CommError::Protocol { peer: 1, detail } if detail.contains(&LIMIT.to_string())),
        "{e}"
    );
}

/// Rank 1 sends one message in each of 100 groups that rank 0 never made: past the few a
/// process takes before it makes them, rank 0 closes the connection, and a receive from
/// rank 1 fails naming it and the unknown group (today it waits until rank 1 is gone).
#[test]
fn messages_in_groups_this_process_does_not_have_are_refused_past_a_few() {
    let res = common::world(2, true, cfg(), |c| {
        if c.rank() == 1 {
            for _ in 0..100 {
                let g = c.group(&[0, 1])?;
                g.send(0, 1, b"hello")?;
            }
            // Stay until rank 0 closes the link (the wait ends with its error).
            let _ = c.recv(0, 9, soon(5));
            return Ok(None);
        }
        let t = Instant::now();
        let e = c.recv(1, 7, soon(20)).expect_err("refused");
        Ok(Some((e, t.elapsed())))
    });
    let (e, after) = res
        .into_iter()
        .next()
        .expect("rank 0")
        .expect("rank 0")
        .expect("its error");
    assert!(
        matches!(&e, CommError::Protocol { peer: 1, detail } if detail.contains("which this process does not have")),
        "{e}"
    );
    assert!(after < Duration::from_secs(4), "refused after {after:?}");
}

/// Rank 1 (the root) broadcasts 8 MiB in a group of both while rank 0 is busy elsewhere:
/// past the limit rank 0 refuses that group's frames from rank 1, and its broadcast fails
/// naming rank 1 and the group; rank 1's point-to-point messages still arrive.
#[test]
fn a_group_whose_queue_passes_the_limit_fails_naming_the_sender() {
    let res = common::world(2, true, cfg(), |c| {
        let g = c.group(&[0, 1])?;
        let mut data = if c.rank() == 1 {
            vec![3u8; 2 * LIMIT]
        } else {
            Vec::new()
        };
        if c.rank() == 1 {
            g.broadcast_bytes(&mut data, 1, 2 * LIMIT)?;
            c.send(0, 4, b"after")?;
            let _ = c.recv(0, 9, soon(5));
            return Ok(None);
        }
        // Busy while the root's frames arrive.
        std::thread::sleep(Duration::from_millis(1500));
        let e = g
            .broadcast_bytes(&mut data, 1, 2 * LIMIT)
            .expect_err("refused");
        let after = c.recv(1, 4, soon(5))?;
        c.send(1, 9, b"done")?;
        Ok(Some((e, after)))
    });
    let (e, after) = res
        .into_iter()
        .next()
        .expect("rank 0")
        .expect("rank 0")
        .expect("its result");
    assert!(
        matches!(&e, CommError::Protocol { peer: 1, detail } if detail.contains("of group ")),
        "{e}"
    );
    assert_eq!(after, b"after");
}
