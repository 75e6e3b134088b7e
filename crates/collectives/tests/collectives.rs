//! The collectives on both transports, and every way a peer can fail.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use shoal_collectives::local::local_group;
use shoal_collectives::tcp::{TcpConfig, TcpTransport, loopback_listeners};
use shoal_collectives::{CollectiveError, Group, Transport};

fn values(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 31 + rank * 17) % 101) as f32 / 7.0 - 3.0)
        .collect()
}

/// Runs every operation on one rank and returns what it saw.
fn exercise<T: Transport>(g: &mut Group<T>, lens: &[usize]) -> Vec<Vec<f32>> {
    let (rank, world) = (g.rank(), g.world());
    let mut seen = Vec::new();
    for &len in lens {
        let mut v = values(rank, len);
        g.all_reduce_sum(&mut v).expect("all-reduce");
        seen.push(v);
    }
    let parts = g.all_gather(&values(rank, rank + 1)).expect("all-gather");
    for (r, p) in parts.iter().enumerate() {
        assert_eq!(p, &values(r, r + 1), "all-gather part of rank {r}");
    }
    let mut b = if rank == 1 {
        b"from one".to_vec()
    } else {
        Vec::new()
    };
    g.broadcast(1, &mut b).expect("broadcast");
    assert_eq!(b, b"from one");
    // A ring of point-to-point messages.
    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    if rank % 2 == 0 {
        g.send(next, &[rank as u8; 3]).expect("send");
        assert_eq!(g.recv(prev).expect("recv"), vec![prev as u8; 3]);
    } else {
        assert_eq!(g.recv(prev).expect("recv"), vec![prev as u8; 3]);
        g.send(next, &[rank as u8; 3]).expect("send");
    }
    g.barrier().expect("barrier");
    seen
}

fn check_sums(world: usize, lens: &[usize], results: &[Vec<Vec<f32>>]) {
    for (i, &len) in lens.iter().enumerate() {
        let mut want = vec![0f32; len];
        for r in 0..world {
            for (w, v) in want.iter_mut().zip(values(r, len)) {
                *w += v;
            }
        }
        for (rank, seen) in results.iter().enumerate() {
            // Bitwise equal on every rank; within rounding of the sequential sum.
            assert_eq!(seen[i], results[0][i], "rank {rank} differs, len {len}");
            for (g, w) in seen[i].iter().zip(&want) {
                assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} vs {w}");
            }
        }
    }
}

/// Small (direct) and large (ring) all-reduces, a length below the world size, and an
/// uneven ring split.
const LENS: [usize; 5] = [1, 2, 576, 40_003, 100_000];

#[test]
fn local_group_computes_every_collective() {
    for world in [1, 2, 3, 4] {
        let groups = local_group(world, Duration::from_secs(10));
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut g| {
                thread::spawn(move || {
                    if g.world() == 1 {
                        let mut v = values(0, 5);
                        g.all_reduce_sum(&mut v).expect("world of one");
                        assert_eq!(v, values(0, 5));
                        return vec![];
                    }
                    exercise(&mut g, &LENS)
                })
            })
            .collect();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect();
        if world > 1 {
            check_sums(world, &LENS, &results);
        }
    }
}

fn tcp_group(world: usize, token: &str, liveness: Duration) -> Vec<Group<TcpTransport>> {
    let listeners = loopback_listeners(world).expect("listeners");
    let addrs: Vec<_> = listeners.iter().map(|(_, a)| *a).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, (l, _))| {
            let mut config = TcpConfig::new(rank, addrs.clone(), token);
            config.liveness = liveness;
            config.setup_timeout = Duration::from_secs(10);
            thread::spawn(move || TcpTransport::connect(&config, l))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            Group::new(
                h.join().expect("join").expect("connect"),
                Duration::from_secs(10),
            )
        })
        .collect()
}

#[test]
fn tcp_group_computes_every_collective() {
    for world in [2, 3] {
        let groups = tcp_group(world, "secret", Duration::from_secs(3));
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut g| thread::spawn(move || exercise(&mut g, &LENS)))
            .collect();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect();
        check_sums(world, &LENS, &results);
    }
}

/// Bytes of a frame as the wire format defines it (see `wire.rs`).
fn frame(kind: u8, op: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = b"SHCL".to_vec();
    h.extend_from_slice(&[kind, 0, 0, 0]);
    h.extend_from_slice(&op.to_le_bytes());
    h.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let mut sum: u32 = 0x811c_9dc5;
    for &b in payload {
        sum ^= b as u32;
        sum = sum.wrapping_mul(0x0100_0193);
    }
    h.extend_from_slice(&sum.to_le_bytes());
    h.extend_from_slice(payload);
    h
}

fn hello(rank: u32, world: u32, token: &str) -> Vec<u8> {
    let mut p = rank.to_le_bytes().to_vec();
    p.extend_from_slice(&world.to_le_bytes());
    p.extend_from_slice(token.as_bytes());
    frame(1, 0, &p)
}

/// Rank 0 of a world of 2 in a thread; the test plays rank 1 over a raw socket.
fn rank0_with_raw_peer(
    liveness: Duration,
) -> (
    thread::JoinHandle<Result<TcpTransport, CollectiveError>>,
    std::net::SocketAddr,
) {
    let mut listeners = loopback_listeners(2).expect("listeners");
    let addrs: Vec<_> = listeners.iter().map(|(_, a)| *a).collect();
    let (l0, a0) = listeners.remove(0);
    let mut config = TcpConfig::new(0, addrs, "secret");
    config.liveness = liveness;
    config.setup_timeout = Duration::from_secs(5);
    (
        thread::spawn(move || TcpTransport::connect(&config, l0)),
        a0,
    )
}

fn raw_join(addr: std::net::SocketAddr, token: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(&hello(1, 2, token)).expect("hello");
    s
}

#[test]
fn a_peer_without_the_token_is_refused_and_the_real_one_still_joins() {
    let (rank0, addr) = rank0_with_raw_peer(Duration::from_secs(3));
    // Wrong token: the connection is closed without a hello back.
    let mut bad = raw_join(addr, "guess");
    bad.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    assert!(
        matches!(bad.read(&mut buf), Ok(0) | Err(_)),
        "a stranger got an answer"
    );
    // Garbage instead of a hello: refused too.
    let mut junk = TcpStream::connect(addr).expect("connect");
    junk.write_all(&[0xAB; 40]).expect("write");
    // The real rank 1 still gets in.
    let mut good = raw_join(addr, "secret");
    good.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut header = [0u8; 24];
    good.read_exact(&mut header).expect("hello back");
    assert_eq!(&header[0..4], b"SHCL");
    let t = rank0.join().expect("join").expect("rank 0 set up");
    drop(t);
}

fn recv_error_after(peer_bytes: &[u8], liveness: Duration) -> (CollectiveError, Duration) {
    let (rank0, addr) = rank0_with_raw_peer(liveness);
    let mut s = raw_join(addr, "secret");
    let mut header = [0u8; 24];
    s.read_exact(&mut header).expect("hello back");
    let t = rank0.join().expect("join").expect("set up");
    let mut g = Group::new(t, Duration::from_secs(20));
    s.write_all(peer_bytes).expect("write");
    let start = Instant::now();
    let err = g.recv(1).expect_err("must fail");
    (err, start.elapsed())
}

#[test]
fn garbage_truncated_and_out_of_step_frames_are_clear_errors() {
    let live = Duration::from_secs(3);
    let (e, _) = recv_error_after(&[0x55; 64], live);
    assert!(matches!(e, CollectiveError::Garbage { peer: 1, .. }), "{e}");
    assert!(e.to_string().contains("magic"), "{e}");

    let mut wrong_sum = frame(2, 1, b"hello");
    let n = wrong_sum.len();
    wrong_sum[n - 1] ^= 1;
    let (e, _) = recv_error_after(&wrong_sum, live);
    assert!(e.to_string().contains("checksum"), "{e}");

    let mut huge = frame(2, 1, b"");
    huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    let (e, _) = recv_error_after(&huge, live);
    assert!(e.to_string().contains("too large"), "{e}");

    let (e, _) = recv_error_after(&frame(9, 1, b""), live);
    assert!(e.to_string().contains("kind"), "{e}");

    let (e, _) = recv_error_after(&frame(2, 7, b"late"), live);
    assert!(
        matches!(
            e,
            CollectiveError::OutOfStep {
                expected: 1,
                got: 7,
                ..
            }
        ),
        "{e}"
    );

    // A truncated frame: header promises 100 bytes, the peer sends 10 and closes.
    let (rank0, addr) = rank0_with_raw_peer(live);
    let mut s = raw_join(addr, "secret");
    let mut header = [0u8; 24];
    s.read_exact(&mut header).expect("hello back");
    let mut g = Group::new(
        rank0.join().expect("join").expect("set up"),
        Duration::from_secs(20),
    );
    let mut f = frame(2, 1, &[7u8; 100]);
    f.truncate(24 + 10);
    s.write_all(&f).expect("write");
    // End the stream after the partial frame (a plain close could reset the connection
    // first, because the test never reads rank 0's heartbeats).
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let e = g.recv(1).expect_err("truncated");
    drop(s);
    assert!(e.to_string().contains("truncated"), "{e}");
    // The failure sticks: later calls fail at once with the cause.
    let e = g.send(1, b"x").expect_err("link is down");
    assert!(
        matches!(e, CollectiveError::LinkDown { peer: 1, .. }),
        "{e}"
    );
}

#[test]
fn a_silent_peer_fails_within_the_liveness_timeout() {
    let liveness = Duration::from_millis(600);
    let (e, took) = recv_error_after(&[], liveness);
    assert!(
        matches!(e, CollectiveError::PeerSilent { peer: 1, .. }),
        "{e}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_live_peer_that_never_sends_hits_the_operation_deadline() {
    let mut groups = tcp_group(2, "secret", Duration::from_millis(600));
    let mut g1 = groups.pop().expect("rank 1");
    let mut g0 = groups.pop().expect("rank 0");
    g0.set_deadline(Duration::from_millis(1500));
    let start = Instant::now();
    // Rank 1 is alive (heartbeats flow) but does not take part.
    let e = g0.recv(1).expect_err("deadline");
    assert!(matches!(e, CollectiveError::Timeout { peer: 1, .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
    // Closing rank 1 is noticed by its peer as a closed connection, not a hang.
    let _ = g1.barrier();
    drop(g1);
}

#[test]
fn a_closed_peer_is_an_error_not_a_hang() {
    let mut groups = tcp_group(3, "secret", Duration::from_secs(2));
    let g2 = groups.pop().expect("rank 2");
    drop(g2);
    let handles: Vec<_> = groups
        .into_iter()
        .map(|mut g| {
            thread::spawn(move || {
                let mut v = vec![1f32; 100_000];
                let start = Instant::now();
                let r = g.all_reduce_sum(&mut v);
                (r.map(|_| ()), start.elapsed())
            })
        })
        .collect();
    for h in handles {
        let (r, took) = h.join().expect("join");
        let e = r.expect_err("rank 2 is gone");
        assert!(took < Duration::from_secs(5), "took {took:?}: {e}");
    }
}

#[test]
fn health_shows_a_dead_peer_to_a_thread_that_never_calls_the_transport() {
    let mut groups = tcp_group(2, "secret", Duration::from_secs(2));
    let g1 = groups.pop().expect("rank 1");
    let g0 = groups.pop().expect("rank 0");
    let health = g0.health();
    assert_eq!(health.failure(), None, "healthy links at the start");
    drop(g1);
    // Rank 0 itself stays idle: only its reader thread sees the close.
    let start = Instant::now();
    while health.failure().is_none() && start.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(10));
    }
    let why = health.failure().expect("the close is seen");
    assert!(why.contains("rank 1"), "{why}");
    // The in-process transport never fails.
    let local = shoal_collectives::local::local_group(2, Duration::from_secs(1));
    assert_eq!(local[0].health().failure(), None);
}
