//! The cable between hosts: frames pass, delay and rate are applied, a cut drops all.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use shoal_testbed::{Shape, Testbed};

/// An echo server on host 2 (one connection, then it ends).
fn echo_server(bed: &Testbed) -> std::thread::JoinHandle<()> {
    let listener = bed
        .within(2, || {
            TcpListener::bind((Testbed::addr(2), 7000)).map_err(|e| shoal_testbed::Error::Io {
                what: "bind".into(),
                source: e,
            })
        })
        .expect("listen in host 2");
    std::thread::spawn(move || {
        while let Ok((mut s, _)) = listener.accept() {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 || s.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    })
}

fn connect(bed: &Testbed) -> TcpStream {
    bed.within(1, || {
        let addr = SocketAddr::from((Testbed::addr(2), 7000));
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| {
            shoal_testbed::Error::Io {
                what: "connect".into(),
                source: e,
            }
        })
    })
    .expect("connect from host 1")
}

/// The fastest of a few round trips of one byte.
fn round_trip(s: &mut TcpStream) -> Duration {
    s.set_nodelay(true).expect("nodelay");
    let mut best = Duration::MAX;
    let mut b = [0u8; 1];
    for _ in 0..5 {
        let t = Instant::now();
        s.write_all(&[1]).expect("write");
        s.read_exact(&mut b).expect("read");
        best = best.min(t.elapsed());
    }
    best
}

#[test]
fn frames_cross_the_cable_late_slow_or_not_at_all() {
    let Some(bed) = Testbed::for_test(2) else {
        return;
    };
    let _server = echo_server(&bed);
    let mut s = connect(&bed);
    let plain = round_trip(&mut s);

    // 5 ms on host 2's cable: each way passes it once, so a round trip gains 10 ms.
    bed.shape(
        2,
        Shape {
            delay: Duration::from_millis(5),
            rate: None,
        },
    );
    let slow = round_trip(&mut s);
    assert!(
        slow >= Duration::from_millis(10),
        "round trip {slow:?} with 5 ms each way (without: {plain:?})"
    );

    // 100 Mbit/s: 4 MB each way take at least 0.32 s (echoed back, through one cable).
    bed.shape(
        2,
        Shape {
            delay: Duration::ZERO,
            rate: Some(100_000_000),
        },
    );
    let data = vec![7u8; 4 << 20];
    let t = Instant::now();
    let mut reader = s.try_clone().expect("clone");
    let back = std::thread::spawn(move || {
        let mut got = vec![0u8; 4 << 20];
        reader.read_exact(&mut got).map(|_| got)
    });
    s.write_all(&data).expect("send 4 MB");
    let got = back.join().expect("reader").expect("echo");
    let took = t.elapsed();
    assert!(got == data, "the bytes changed on the way");
    assert!(
        took >= Duration::from_millis(320),
        "4 MB at 100 Mbit/s in {took:?}"
    );
    eprintln!("round trip {plain:?} plain, {slow:?} with 5 ms; 4 MB at 100 Mbit/s in {took:?}");

    // Cut: nothing arrives, and the socket notices nothing by itself.
    bed.shape(2, Shape::default());
    bed.cut(2);
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    s.write_all(&[9]).expect("write into a cut cable");
    let mut b = [0u8; 1];
    let err = s
        .read_exact(&mut b)
        .expect_err("an answer through a cut cable");
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock, "{err}");
    // Healed, the byte is retransmitted and answered.
    bed.heal(2);
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.read_exact(&mut b).expect("the echo after healing");
    assert_eq!(b, [9]);
}
