//! The shared-memory transport (`CommConfig::transport`): ranks of one host reduce through
//! a shared segment. Worlds of 1 to 5 ranks (threads as ranks, in-memory links and over
//! 127.0.0.1), lengths 0, 1, odd and several chunks: bitwise the serial left-to-right `f32`
//! sum in rank order on every rank; buckets started back to back; sub-groups; broadcast;
//! the file-backed fallback directory; and real processes: a killed rank named by every
//! survivor, a stalled one by the deadline, no file left behind.

#[allow(dead_code)] // the world helpers are the in-process tests'
mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{CommConfig, CommError, ProcessGroup, Secret, TcpGroup, Transport};

const TEST_DEADLINE: Duration = Duration::from_secs(60);
/// Slots of 4 KiB (1024 floats): the lengths below span several chunks.
const CHUNK: usize = 4096;
const LENGTHS: [usize; 6] = [0, 1, 7, 1023, 1024, 5 * 1024 + 13];

fn cfg(n: usize, transport: Transport) -> CommConfig {
    CommConfig::new(Some(0), n)
        .with_secret(Some(
            flotilla_tcp::Secret::new(b"flotilla-test-secret-0123456789".to_vec()).expect("secret"),
        ))
        .with_timeout(Duration::from_secs(10))
        .with_join_timeout(Duration::from_secs(20))
        .with_transport(transport)
        .with_shm_chunk_bytes(CHUNK)
}

/// Runs `body` on every rank of an `n`-rank world built from `c`, each rank a thread;
/// `tcp` picks a rendezvous over 127.0.0.1, else in-memory links.
fn world<T, F>(n: usize, tcp: bool, c: CommConfig, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(TcpGroup) -> Result<T, CommError> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    let comms: Vec<Box<dyn FnOnce() -> Result<TcpGroup, CommError> + Send>> = if tcp {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let mut l = Some(l);
        (0..n)
            .map(|r| {
                let mut c = c.clone().with_master("127.0.0.1", port);
                c.rank = Some(r);
                let l = l.take().filter(|_| r == 0);
                Box::new(move || match l {
                    Some(l) => TcpGroup::connect_with_listener(c, l),
                    None => TcpGroup::connect(c),
                }) as Box<dyn FnOnce() -> _ + Send>
            })
            .collect()
    } else {
        TcpGroup::in_memory(n, c)
            .expect("in-memory world")
            .into_iter()
            .map(|c| Box::new(move || Ok(c)) as Box<dyn FnOnce() -> _ + Send>)
            .collect()
    };
    for (r, make) in comms.into_iter().enumerate() {
        let (tx, body) = (tx.clone(), body.clone());
        thread::spawn(move || {
            let _ = tx.send((r, make().and_then(|c| body(c))));
        });
    }
    let deadline = Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).expect("test world hung");
        out[r] = Some(res.unwrap_or_else(|e| panic!("rank {r}: {e}")));
    }
    out.into_iter().map(|r| r.expect("result")).collect()
}

/// SplitMix64: deterministic pseudo-random bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rank `r`'s input of `len` floats (varied magnitudes and signs, so the order of the
/// additions shows in the bits).
fn input(r: usize, len: usize, salt: u64) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let bits = mix(salt ^ ((r as u64) << 40) ^ i as u64);
            let mag = ((bits >> 8) % 2000) as f32 / 7.0 - 140.0;
            mag * 10f32.powi((bits % 7) as i32 - 3)
        })
        .collect()
}

/// The serial left-to-right `f32` sum in rank order, and the f64 sum with its bound.
fn reference(n: usize, len: usize, salt: u64) -> (Vec<f32>, Vec<f64>, Vec<f64>) {
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len, salt)).collect();
    let serial = (0..len)
        .map(|i| inputs[1..].iter().fold(inputs[0][i], |a, x| a + x[i]))
        .collect();
    let exact = (0..len)
        .map(|i| inputs.iter().map(|x| f64::from(x[i])).sum())
        .collect();
    let bound = (0..len)
        .map(|i| {
            let abs: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
            n as f64 * f64::from(f32::EPSILON) * abs
        })
        .collect();
    (serial, exact, bound)
}

fn check_sums(n: usize, tcp: bool) {
    check_sums_of(n, tcp, cfg(n, Transport::Shm), &LENGTHS);
}

/// Every rank's all-reduce of each of `lengths` under `c` is bitwise the serial rank-order
/// sum (and within the error bound of the exact one).
fn check_sums_of(n: usize, tcp: bool, c: CommConfig, lengths: &'static [usize]) {
    let results = world(n, tcp, c, move |c| {
        let mut out = Vec::new();
        for (k, &len) in lengths.iter().enumerate() {
            let mut buf = input(c.rank(), len, k as u64);
            c.all_reduce_sum(&mut buf)?;
            out.push(buf);
        }
        Ok((out, c.stats()))
    });
    for (k, &len) in lengths.iter().enumerate() {
        let (serial, exact, bound) = reference(n, len, k as u64);
        for (r, (got, _)) in results.iter().enumerate() {
            let got = &got[k];
            for i in 0..len {
                assert_eq!(
                    got[i].to_bits(),
                    serial[i].to_bits(),
                    "n {n} len {len} rank {r} [{i}]: {} vs serial {}",
                    got[i],
                    serial[i]
                );
                let err = (f64::from(got[i]) - exact[i]).abs();
                assert!(err <= bound[i], "n {n} len {len} [{i}]: error {err}");
            }
        }
    }
    let floats: usize = lengths.iter().sum();
    for (_, stats) in &results {
        let want = if n > 1 { 4 * floats as u64 } else { 0 };
        assert_eq!(stats.shm_bytes, want, "n {n}: bytes through shared memory");
    }
}

#[test]
fn sums_are_the_serial_rank_order_sum_on_every_rank_in_memory() {
    for n in 1..=5 {
        check_sums(n, false);
    }
}

#[test]
fn sums_are_the_serial_rank_order_sum_on_every_rank_over_tcp_rendezvous() {
    for n in [2, 3, 4] {
        check_sums(n, true);
    }
}

/// The chunked all-reduce alone (no one-step path): each rank reduces its slice of a chunk
/// into every other rank's slot, where that rank copies the result out. Lengths shorter
/// than the group (slices of 0 floats), not divisible by it, one float past a chunk, several
/// chunks with a short last one; 2 ranks (the fused pass), 3 and 5 (blocks).
#[test]
fn chunked_sums_of_any_length_are_the_serial_rank_order_sum_on_every_rank() {
    const CHUNKED: [usize; 9] = [1, 2, 3, 4, 7, 1023, 1025, 2048, 3 * 1024 + 2];
    for n in [2, 3, 5] {
        let c = cfg(n, Transport::Shm).with_small_all_reduce_bytes(0);
        check_sums_of(n, false, c, &CHUNKED);
    }
}

#[test]
fn buckets_started_back_to_back_complete_in_order_with_the_right_sums() {
    let n = 4;
    let lens: Vec<usize> = (0..24).map(|b| (b * 977) % 6000).collect();
    let lens2 = lens.clone();
    let results = world(n, false, cfg(n, Transport::Auto), move |c| {
        let pending: Vec<_> = lens2
            .iter()
            .enumerate()
            .map(|(b, &len)| c.all_reduce_bucket(input(c.rank(), len, 100 + b as u64), b))
            .collect();
        pending
            .into_iter()
            .map(|p| p.wait())
            .collect::<Result<Vec<Vec<f32>>, CommError>>()
    });
    for (b, &len) in lens.iter().enumerate() {
        let (serial, _, _) = reference(n, len, 100 + b as u64);
        for (r, got) in results.iter().enumerate() {
            assert_eq!(got[b].len(), len, "rank {r} bucket {b}");
            let bad = (0..len).find(|&i| got[b][i].to_bits() != serial[i].to_bits());
            assert_eq!(bad, None, "rank {r} bucket {b}: first element off");
        }
    }
}

/// One-step all-reduces (at most `SMALL` bytes), chunked ones and broadcasts of changing
/// lengths follow each other with no barrier between them: every result is bitwise the
/// serial rank-order sum (or the root's buffer) on every rank, although fast ranks start
/// the next collective while slow ones still read the last (4 ranks on this machine's
/// cores are preempted often).
#[test]
fn collectives_of_any_kind_and_length_follow_each_other_without_a_barrier() {
    const SMALL: usize = 64 << 10;
    const OPS: usize = 90;
    let n = 4;
    let len = |i: usize| [16384, 5, 40000, 9000, 16385, 1, 0, 12000, 33000][i % 9];
    let c = cfg(n, Transport::Shm)
        .with_shm_chunk_bytes(SMALL)
        .with_small_all_reduce_bytes(SMALL);
    let results = world(n, false, c, move |c| {
        let mut out = Vec::new();
        for i in 0..OPS {
            let (r, root) = (c.rank(), i % n);
            if i % 3 == 2 {
                let mut b = if r == root {
                    input(r, len(i), i as u64)
                } else {
                    vec![0.0; len(i)]
                };
                c.broadcast_f32(&mut b, root)?;
                out.push(b);
            } else {
                let mut b = input(r, len(i), i as u64);
                c.all_reduce_sum(&mut b)?;
                out.push(b);
            }
        }
        Ok(out)
    });
    for i in 0..OPS {
        let want = if i % 3 == 2 {
            input(i % n, len(i), i as u64)
        } else {
            reference(n, len(i), i as u64).0
        };
        for (r, got) in results.iter().enumerate() {
            let bad = (0..len(i)).find(|&k| got[i][k].to_bits() != want[k].to_bits());
            assert_eq!(
                bad,
                None,
                "op {i} (length {}) rank {r}: first element off",
                len(i)
            );
        }
    }
}

/// The barrier of a group on shared memory goes through its segment (no frame sent once
/// the segment is set up) and still holds every rank until the last one arrives.
#[test]
fn a_barrier_on_shared_memory_sends_no_frame_and_waits_for_the_last_rank() {
    const LATE: Duration = Duration::from_millis(300);
    let n = 3;
    let results = world(n, true, cfg(n, Transport::Shm), |c| {
        let mut b = vec![1.0f32; 10];
        c.all_reduce_sum(&mut b)?;
        let before = c.stats().frames_sent;
        for _ in 0..20 {
            c.barrier()?;
        }
        if c.rank() == 2 {
            thread::sleep(LATE);
        }
        let t = Instant::now();
        c.barrier()?;
        Ok((c.stats().frames_sent - before, t.elapsed()))
    });
    for (r, (frames, waited)) in results.iter().enumerate() {
        assert_eq!(*frames, 0, "rank {r}: frames sent by 21 barriers");
        if r != 2 {
            assert!(
                *waited >= LATE / 2,
                "rank {r} left the barrier after {waited:?}"
            );
        }
    }
}

/// Sub-groups all-reduce over their own segments; broadcasts, in the world and in a
/// sub-group, go through the segments too: no frame sent by any rank (the segments were
/// set up by the all-reduces), and each root's bytes counted as shared-memory traffic.
#[test]
fn split_groups_reduce_over_their_own_segments_and_broadcast_works() {
    let n = 5;
    let results = world(n, false, cfg(n, Transport::Shm), |c| {
        let r = c.rank();
        let sub = c.split(Some((r % 2) as u32), r as i64)?.expect("a member");
        let mut buf = input(r, 3000, 7);
        sub.all_reduce_sum(&mut buf)?;
        let mut whole = input(r, 3000, 8);
        c.all_reduce_sum(&mut whole)?;
        let before = c.stats();
        let mut b = if r == 3 {
            input(3, 2500, 9)
        } else {
            vec![0.0; 2500]
        };
        c.broadcast_f32(&mut b, 3)?;
        let sub_root = sub.rank() == 1;
        let mut sb = if sub_root {
            input(r, 1500, 10)
        } else {
            vec![0.0; 1500]
        };
        sub.broadcast_f32(&mut sb, 1)?;
        let after = c.stats();
        let broadcasts = (
            after.frames_sent - before.frames_sent,
            after.shm_bytes - before.shm_bytes,
            sub_root,
        );
        Ok((buf, whole, b, sb, after.shm_bytes, broadcasts))
    });
    let (whole, _, _) = reference(n, 3000, 8);
    for (r, (buf, w, b, sb, shm, (frames, shm_bytes, sub_root))) in results.iter().enumerate() {
        assert_eq!(*frames, 0, "rank {r}: frames sent by the broadcasts");
        let rooted = if r == 3 { 4 * 2500 } else { 0 } + if *sub_root { 4 * 1500 } else { 0 };
        assert_eq!(
            *shm_bytes, rooted,
            "rank {r}: bytes broadcast through shared memory"
        );
        let members: Vec<usize> = (0..n).filter(|m| m % 2 == r % 2).collect();
        let inputs: Vec<Vec<f32>> = members.iter().map(|&m| input(m, 3000, 7)).collect();
        for i in 0..3000 {
            let serial = inputs[1..].iter().fold(inputs[0][i], |a, x| a + x[i]);
            assert_eq!(
                buf[i].to_bits(),
                serial.to_bits(),
                "rank {r} sub-group [{i}]"
            );
            assert_eq!(w[i].to_bits(), whole[i].to_bits(), "rank {r} world [{i}]");
        }
        assert_eq!(b, &input(3, 2500, 9), "rank {r}: world broadcast");
        assert_eq!(
            sb,
            &input(members[1], 1500, 10),
            "rank {r}: sub-group broadcast"
        );
        assert!(
            *shm >= 4 * 6000,
            "rank {r}: {shm} bytes through shared memory"
        );
    }
}

#[test]
fn a_configured_directory_holds_the_segment_until_all_mapped_it() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().to_path_buf();
    let n = 3;
    let c = cfg(n, Transport::Shm).with_shm_dir(Some(path.clone()));
    let results = world(n, false, c, move |c| {
        let mut buf = input(c.rank(), 4000, 11);
        c.all_reduce_sum(&mut buf)?;
        // Every member mapped the segment: its file is gone, the mappings work on.
        c.barrier()?;
        let left = std::fs::read_dir(&path).map(|d| d.count()).unwrap_or(0);
        let mut again = input(c.rank(), 4000, 12);
        c.all_reduce_sum(&mut again)?;
        Ok((buf, again, left))
    });
    let (first, _, _) = reference(n, 4000, 11);
    let (second, _, _) = reference(n, 4000, 12);
    for (r, (a, b, left)) in results.iter().enumerate() {
        assert_eq!(*left, 0, "rank {r}: the segment's file outlived the setup");
        assert_eq!(a, &first, "rank {r}");
        assert_eq!(b, &second, "rank {r}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

#[test]
fn transport_tcp_sends_everything_over_tcp() {
    // `tcp`: nothing goes through shared memory.
    let results = world(2, false, cfg(2, Transport::Tcp), |c| {
        let mut buf = input(c.rank(), 100_000, 13);
        c.all_reduce_sum(&mut buf)?;
        Ok(c.stats())
    });
    assert!(
        results
            .iter()
            .all(|s| s.shm_bytes == 0 && s.bytes_sent > 400_000)
    );
}

/// The environment of a child rank (a process running `child_rank` of this binary).
const CHILD: &str = "FLOTILLA_SHM_TEST_CHILD";

/// One rank of the process tests: all-reduces until told to stop by an error, then prints
/// it. Mode `stall`: rank 2 stops taking part after its third all-reduce.
#[test]
fn child_rank() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let mut c = common::child_config();
    c.timeout = Duration::from_secs(if mode == "hold" { 60 } else { 3 });
    c.transport = Transport::Shm;
    let comm = TcpGroup::connect(c).expect("child connects");
    if mode == "hold" && comm.rank() == 1 {
        // Rank 0 waits in the setup of the first all-reduce, its segment's file created.
        thread::sleep(Duration::from_secs(60));
        return;
    }
    let mut buf = vec![1.0f32; 300_000];
    for i in 0..200_000u64 {
        if i == 3 {
            println!("READY");
        }
        if mode == "stall" && comm.rank() == 2 && i == 3 {
            thread::sleep(Duration::from_secs(60));
        }
        if let Err(e) = comm.all_reduce_sum(&mut buf) {
            println!("ERR: {e}");
            return;
        }
        buf.fill(1.0);
    }
    println!("DONE");
}

fn spawn_rank(rank: usize, n: usize, port: u16, mode: &str, dir: &Path) -> Child {
    rank_command(rank, n, port, mode, dir)
        .spawn()
        .expect("spawn a rank")
}

/// The command of rank `rank` of `n` (`child_rank` in `mode`), segments in `dir`.
fn rank_command(rank: usize, n: usize, port: u16, mode: &str, dir: &Path) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary"));
    c.args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
        .env(CHILD, mode)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("FLOTILLA_SECRET", "flotilla-test-secret-0123456789")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("CHILD_SHM_DIR", dir)
        .env("CHILD_SHM_CHUNK_BYTES", CHUNK.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    c
}

/// Starts 3 ranks, waits until all are reducing, kills rank 2 (`kill`) or lets it stall,
/// and returns each survivor's outcome line and how long after the kill it came.
fn three_processes(mode: &str, kill: bool) -> Vec<(String, Duration)> {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("segment directory");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut kids: Vec<Child> = (0..3)
        .map(|r| spawn_rank(r, 3, port, mode, dir.path()))
        .collect();
    let (tx, rx) = mpsc::channel();
    for (r, k) in kids.iter_mut().enumerate() {
        let out = BufReader::new(k.stdout.take().expect("stdout"));
        let tx = tx.clone();
        thread::spawn(move || {
            // The test harness may print its own words before ours on a line.
            for line in out.lines().map_while(Result::ok) {
                let mark = ["READY", "ERR", "DONE"].iter().find_map(|m| line.find(m));
                if let Some(at) = mark {
                    let _ = tx.send((r, line[at..].to_string(), Instant::now()));
                }
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut ready = 0;
    let mut outcomes = vec![None; 3];
    let mut killed_at = Instant::now();
    while outcomes[..2].iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((r, line, at)) = rx.recv_timeout(left) else {
            break;
        };
        if line == "READY" {
            ready += 1;
            if ready == 3 && kill {
                let _ = kids[2].kill();
                killed_at = Instant::now();
            } else if ready == 2 && !kill {
                killed_at = Instant::now();
            }
        } else {
            outcomes[r] = Some((line, at.saturating_duration_since(killed_at)));
        }
    }
    for k in &mut kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
    outcomes[..2]
        .iter()
        .enumerate()
        .map(|(r, o)| o.clone().unwrap_or_else(|| panic!("rank {r} never failed")))
        .collect()
}

#[test]
fn a_killed_rank_is_named_by_every_survivor_and_nothing_is_left_behind() {
    for (r, (line, after)) in three_processes("kill", true).into_iter().enumerate() {
        assert!(
            line.starts_with("ERR") && line.contains("rank 2"),
            "rank {r}: {line}"
        );
        assert!(
            after < Duration::from_secs(3),
            "rank {r} took {after:?}: {line}"
        );
    }
}

#[test]
fn a_stalled_rank_is_named_at_the_deadline() {
    for (r, (line, after)) in three_processes("stall", false).into_iter().enumerate() {
        assert!(
            line.starts_with("ERR") && line.contains("rank 2"),
            "rank {r}: {line}"
        );
        assert!(line.contains("timed out"), "rank {r}: {line}");
        assert!(
            after < Duration::from_secs(10),
            "rank {r} took {after:?}: {line}"
        );
    }
}

#[test]
fn groups_of_replicas_broadcast_then_reduce_buckets_concurrently() {
    let n = 4;
    let results = world(n, false, cfg(n, Transport::Auto), |c| {
        let r = c.rank();
        let members: Vec<usize> = (0..2).map(|d| d * 2 + r % 2).collect();
        let g = c.group(&members)?;
        let mut b = if g.rank() == 0 {
            input(r, 5000, 20)
        } else {
            vec![0.0; 5000]
        };
        g.broadcast_f32(&mut b, 0)?;
        let mut out = Vec::new();
        for step in 0..3u64 {
            let pending: Vec<_> = (0..3)
                .map(|k| g.all_reduce_bucket(input(r, 700 + 900 * k, 30 + step * 3 + k as u64), k))
                .collect();
            for p in pending {
                out.push(p.wait()?);
            }
        }
        Ok((b, out))
    });
    for (r, (b, out)) in results.iter().enumerate() {
        assert_eq!(b, &input(r % 2, 5000, 20), "rank {r}: broadcast");
        let mut i = 0;
        for step in 0..3u64 {
            for k in 0..3usize {
                let len = 700 + 900 * k;
                let salt = 30 + step * 3 + k as u64;
                let (a, c) = (input(r % 2, len, salt), input(r % 2 + 2, len, salt));
                let want: Vec<f32> = a.iter().zip(&c).map(|(x, y)| x + y).collect();
                assert_eq!(out[i], want, "rank {r} step {step} bucket {k}");
                i += 1;
            }
        }
    }
}

/// A test secret (every TCP rank of a new test has one).
fn secret() -> Secret {
    Secret::new(b"test-secret-0123456789".to_vec()).expect("secret")
}

/// Runs `body` on two ranks over 127.0.0.1, rank `r` configured by `cfgs[r]`; each rank's
/// result.
fn pair<T: Send + 'static>(
    cfgs: [CommConfig; 2],
    body: fn(&TcpGroup) -> Result<T, CommError>,
) -> Vec<Result<T, CommError>> {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let mut l = Some(l);
    let (tx, rx) = mpsc::channel();
    for (r, c) in cfgs.into_iter().enumerate() {
        let mut c = c.with_master("127.0.0.1", port);
        c.rank = Some(r);
        let (tx, l) = (tx.clone(), l.take().filter(|_| r == 0));
        thread::spawn(move || {
            let comm = match l {
                Some(l) => TcpGroup::connect_with_listener(c, l),
                None => TcpGroup::connect(c),
            };
            let _ = tx.send((r, comm.and_then(|c| body(&c))));
        });
    }
    let deadline = Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<Result<T, CommError>>> = vec![None, None];
    for _ in 0..2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).expect("test world hung");
        out[r] = Some(res);
    }
    out.into_iter().map(|r| r.expect("result")).collect()
}

/// Every layout parameter of a segment is in its header: a member configured differently
/// from rank 0 (its one-step size, its slot size) makes every member fail with a
/// configuration error naming the setting, under the default `transport: auto` too (not
/// a fall back to TCP, not sums read from the wrong slots).
#[test]
fn members_configured_differently_fail_naming_the_setting() {
    let base = || {
        let mut c = cfg(2, Transport::Auto);
        c.secret = Some(secret());
        c
    };
    let cases = [
        (
            "small_all_reduce_bytes",
            base().with_small_all_reduce_bytes(1024),
        ),
        ("shm_chunk_bytes", base().with_shm_chunk_bytes(2 * CHUNK)),
    ];
    for (setting, other) in cases {
        let res = pair([base(), other], |c| {
            // 700 floats: one step for rank 0 (up to 1024), chunked for 256.
            let mut b = input(c.rank(), 700, 40);
            c.all_reduce_sum(&mut b).map(|()| b)
        });
        for (r, res) in res.iter().enumerate() {
            match res {
                Err(CommError::Config(m)) => assert!(m.contains(setting), "rank {r}: {m}"),
                other => panic!("rank {r}, {setting} differing: {other:?}"),
            }
        }
    }
}

/// Kills its processes when dropped.
struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for k in &mut self.0 {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

/// A segment's file left by a killed rank 0 (killed between creating it and every member
/// mapping it) is removed by the next job's setup in that directory; the file of a rank 0
/// still alive in that state is not.
#[test]
fn a_segment_left_by_a_killed_rank_0_is_swept_and_a_live_ones_kept() {
    let dir = tempfile::tempdir().expect("segment directory");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut kids = Kids(
        (0..2)
            .map(|r| {
                let mut c = rank_command(r, 2, port, "hold", dir.path());
                c.env("FLOTILLA_SECRET", "test-secret-0123456789")
                    .stdout(Stdio::null());
                c.spawn().expect("spawn a rank")
            })
            .collect(),
    );
    let files = || -> Vec<_> {
        let d = std::fs::read_dir(dir.path()).expect("segment directory");
        d.map(|e| e.expect("entry").path()).collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let held = loop {
        let f = files();
        if !f.is_empty() {
            break f;
        }
        assert!(
            Instant::now() < deadline,
            "rank 0 never created its segment"
        );
        thread::sleep(Duration::from_millis(10));
    };
    let job = || {
        let c = cfg(2, Transport::Shm).with_shm_dir(Some(dir.path().to_path_buf()));
        let sums = world(2, false, c, |c| {
            let mut b = input(c.rank(), 100, 50);
            c.all_reduce_sum(&mut b).map(|()| b)
        });
        assert_eq!(sums[0], reference(2, 100, 50).0, "the next job's sums");
    };
    job();
    assert_eq!(files(), held, "a live rank 0's segment was removed");
    let _ = kids.0[0].kill();
    let _ = kids.0[0].wait();
    assert_eq!(files(), held, "the file outlived its killed creator");
    job();
    assert_eq!(files(), Vec::<std::path::PathBuf>::new(), "not swept");
}
