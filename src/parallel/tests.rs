//! Tests of the collectives and the worker pool. Every test that could deadlock on a bug runs its
//! body under [`within`], so a bug fails the test instead of hanging the suite.

use super::worker::split_core_list;
use super::*;
use anyhow::anyhow;
use crossbeam::channel::{self, RecvTimeoutError};
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = channel::bounded(1);
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => panic!("test did not finish within {secs} s (deadlock?)"),
        Err(RecvTimeoutError::Disconnected) => panic!("test body panicked (see above)"),
    }
}

/// Runs `f(rank, collective)` on `world` threads and returns the results in rank order.
fn on_ranks<T: Send + 'static>(world: usize, f: impl Fn(usize, &InProcess) -> T + Send + Sync + 'static) -> Vec<T> {
    within(60, move || {
        let c = Arc::new(InProcess::new(world).expect("world > 0"));
        let f = Arc::new(f);
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (c, f) = (Arc::clone(&c), Arc::clone(&f));
                std::thread::spawn(move || f(r, &c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

#[test]
fn shard_range_covers_without_overlap() {
    for world in 1..=5 {
        for total in [0, 1, world - 1, world + 1, 7, 1000003] {
            let ranges: Vec<_> = (0..world).map(|r| shard_range(total, world, r)).collect();
            assert_eq!(ranges[0].start, 0, "total {total} world {world}");
            assert_eq!(ranges[world - 1].end, total, "total {total} world {world}");
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start, "gap or overlap: total {total} world {world}");
                assert!(w[0].len() == w[1].len() || w[0].len() == w[1].len() + 1, "{ranges:?}");
            }
        }
    }
}

#[test]
fn reduce_scatter_sums_exactly() {
    for world in 1..=4 {
        for total in [7usize, 10, 1] {
            let got = on_ranks(world, move |r, c| {
                let send: Vec<f32> = (0..total).map(|i| (r * 1000 + i) as f32).collect();
                let mut recv = vec![f32::NAN; shard_range(total, world, r).len()];
                c.reduce_scatter_sum(r, &send, &mut recv).map(|_| recv)
            });
            for (r, recv) in got.into_iter().enumerate() {
                let want: Vec<f32> =
                    shard_range(total, world, r).map(|i| (1000 * world * (world - 1) / 2 + world * i) as f32).collect();
                assert_eq!(recv.expect("reduce_scatter_sum"), want, "world {world} total {total} rank {r}");
            }
        }
    }
}

#[test]
fn all_gather_reassembles_and_scalars_reduce() {
    for world in 1..=4 {
        let total = 11;
        let got = on_ranks(world, move |r, c| -> anyhow::Result<(Vec<f32>, f64, Vec<f32>)> {
            let shard: Vec<f32> = shard_range(total, world, r).map(|i| i as f32 * 0.5).collect();
            let mut out = vec![f32::NAN; total];
            c.all_gather(r, &shard, &mut out)?;
            let sum = c.all_reduce_sum_f64(r, (r + 1) as f64)?;
            let mut buf = if r == world - 1 { vec![1.0, 2.0, 3.0] } else { vec![9.0; r * 5] };
            c.broadcast(r, world - 1, &mut buf)?;
            Ok((out, sum, buf))
        });
        let full: Vec<f32> = (0..total).map(|i| i as f32 * 0.5).collect();
        for (r, res) in got.into_iter().enumerate() {
            let (out, sum, buf) = res.expect("collectives");
            assert_eq!(out, full, "all_gather world {world} rank {r}");
            assert_eq!(sum, (world * (world + 1) / 2) as f64, "all_reduce world {world} rank {r}");
            assert_eq!(buf, vec![1.0, 2.0, 3.0], "broadcast world {world} rank {r}");
        }
    }
}

#[test]
fn all_gather_u16_moves_every_bit_pattern() {
    // Odd and even shard lengths, and values that are NaNs (quiet and signalling), infinities,
    // subnormals and ±0 once read as BF16 or as the halves of an f32 word.
    for world in 1..=4 {
        for total in [1usize, 2, 7, 10, 13] {
            let full: Vec<u16> = (0..total)
                .map(|i| {
                    [0x7FC1, 0xFF81, 0x7F80, 0x0001, 0x8000, 0x3F80, 0x0000][i % 7] ^ ((i as u16 * 0x0100) & 0x0F00)
                })
                .collect();
            let src = full.clone();
            let got = on_ranks(world, move |r, c| {
                let mut out = vec![0xAAAAu16; total];
                c.all_gather_u16(r, &src[shard_range(total, world, r)], &mut out).map(|_| out)
            });
            for (r, out) in got.into_iter().enumerate() {
                assert_eq!(out.expect("all_gather_u16"), full, "world {world} total {total} rank {r}");
            }
        }
    }
}

#[test]
fn all_gather_u16_with_a_wrong_shard_fails_on_every_rank() {
    let got = on_ranks(3, |r, c| {
        let mut out = vec![0u16; 8];
        // Rank 1 sends one value too many (its shard of 8 over 3 ranks is 3).
        let shard = vec![1u16; shard_range(8, 3, r).len() + usize::from(r == 1)];
        c.all_gather_u16(r, &shard, &mut out).map_err(|e| format!("{e:#}"))
    });
    for (r, res) in got.iter().enumerate() {
        let e = res.as_ref().expect_err("must fail");
        assert!(e.contains("rank 1 contributed 4 values for its shard of 3"), "rank {r}: {e}");
    }
}

fn noisy(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let unit = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * 10f32.powi((i % 7) as i32 - 3)
        })
        .collect()
}

#[test]
fn sums_are_bit_reproducible_in_rank_order() {
    let (world, total) = (4usize, 1001usize);
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| noisy(r as u64 + 1, total)).collect();
    let reference: Vec<f32> = (0..total).map(|i| inputs[1..].iter().fold(inputs[0][i], |acc, v| acc + v[i])).collect();
    let reversed: Vec<f32> =
        (0..total).map(|i| inputs[..world - 1].iter().rev().fold(inputs[world - 1][i], |acc, v| acc + v[i])).collect();
    assert!(reference.iter().zip(&reversed).any(|(a, b)| a.to_bits() != b.to_bits()), "inputs too tame to test order");
    let inputs = Arc::new(inputs);
    for rep in 0..20u64 {
        let inputs = Arc::clone(&inputs);
        let got = on_ranks(world, move |r, c| {
            // Perturb arrival order from one repetition to the next.
            std::thread::sleep(Duration::from_micros(((r as u64 * 7 + rep * 3) % 5) * 300));
            let mut recv = vec![0.0; shard_range(total, world, r).len()];
            c.reduce_scatter_sum(r, &inputs[r], &mut recv).map(|_| recv)
        });
        let gathered: Vec<u32> =
            got.into_iter().flat_map(|g| g.expect("reduce_scatter_sum")).map(f32::to_bits).collect();
        assert_eq!(gathered, reference.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "repetition {rep}");
    }
}

#[test]
fn many_rounds_reuse_the_slots_safely() {
    let world = 3;
    let got = on_ranks(world, move |r, c| -> anyhow::Result<()> {
        for round in 0..300usize {
            let total = 5 + round % 4;
            let send: Vec<f32> = (0..total).map(|i| (round * 10 + r + i) as f32).collect();
            let mut recv = vec![0.0; shard_range(total, world, r).len()];
            c.reduce_scatter_sum(r, &send, &mut recv)?;
            for (k, i) in shard_range(total, world, r).enumerate() {
                let want = (world * (round * 10 + i) + world * (world - 1) / 2) as f32;
                anyhow::ensure!(recv[k] == want, "round {round} rank {r} element {i}: {} != {want}", recv[k]);
            }
            let s = c.all_reduce_sum_f64(r, (round + r) as f64)?;
            anyhow::ensure!(s == (world * round + 3) as f64, "round {round}: all_reduce gave {s}");
        }
        Ok(())
    });
    for (r, res) in got.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e:#}"));
    }
}

#[test]
fn abort_unblocks_a_waiting_rank() {
    let err = within(30, || {
        let c = Arc::new(InProcess::new(3).expect("world 3"));
        let c0 = Arc::clone(&c);
        let waiter = std::thread::spawn(move || c0.all_reduce_sum_f64(0, 1.0));
        std::thread::sleep(Duration::from_millis(50));
        c.abort("rank 2 lost its device");
        let first = waiter.join().expect("rank 0 thread").expect_err("rank 0 must fail");
        let later = c.all_reduce_sum_f64(1, 1.0).expect_err("aborted groups stay aborted");
        (first.to_string(), later.to_string())
    });
    assert_eq!(err.0, "collective aborted: rank 2 lost its device");
    assert_eq!(err.1, "collective aborted: rank 2 lost its device");
}

#[test]
fn mismatched_calls_fail_on_every_rank() {
    let got = on_ranks(2, |r, c| {
        let err = if r == 0 {
            c.all_gather(0, &[1.0], &mut [0.0, 0.0]).map(|_| ())
        } else {
            c.all_reduce_sum_f64(1, 1.0).map(|_| ())
        };
        err.expect_err("mismatch must fail").to_string()
    });
    for msg in got {
        assert!(msg.contains("rank 0 called all_gather while rank 1 called all_reduce_sum_f64"), "{msg}");
    }
    let got = on_ranks(2, |r, c| {
        let mut recv = vec![0.0; if r == 1 { 5 } else { 2 }];
        c.reduce_scatter_sum(r, &[1.0; 4], &mut recv).expect_err("bad recv length must fail").to_string()
    });
    for msg in got {
        assert!(msg.contains("rank 1 receives into 5 values, its shard of 4 over 2 ranks has 2"), "{msg}");
    }
    let got = on_ranks(2, |r, c| c.all_reduce_sum_f64(r + 1, 0.0).map_err(|e| e.to_string()));
    assert!(got.iter().all(|g| g.is_err()), "an out-of-range rank must abort the group: {got:?}");
}

#[test]
fn world_one_is_a_pass_through() {
    let c = InProcess::new(1).expect("world 1");
    let mut recv = [0.0; 3];
    c.reduce_scatter_sum(0, &[1.0, 2.0, 3.0], &mut recv).expect("reduce_scatter_sum");
    assert_eq!(recv, [1.0, 2.0, 3.0]);
    let mut out = [0.0; 2];
    c.all_gather(0, &[4.0, 5.0], &mut out).expect("all_gather");
    assert_eq!(out, [4.0, 5.0]);
    assert_eq!(c.all_reduce_sum_f64(0, 2.5).expect("all_reduce"), 2.5);
    assert!(c.reduce_scatter_sum(0, &[1.0], &mut out).is_err(), "length mismatch must fail");
    assert!(InProcess::new(0).is_err());
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|r| format!("cpu:{r}")).collect()
}

fn counter_pool(n: usize) -> WorkerPool<u64> {
    WorkerPool::spawn(names(n), vec![Vec::new(); n], |_| Ok(0u64)).expect("spawn")
}

#[test]
fn run_all_returns_results_in_rank_order_and_state_persists() {
    let pool = counter_pool(4);
    let got = pool
        .run_all("order", |rank, _| {
            // Later ranks finish first, so replies arrive out of order.
            std::thread::sleep(Duration::from_millis((4 - rank as u64) * 10));
            Ok(rank * 10)
        })
        .expect("run_all");
    assert_eq!(got, vec![0, 10, 20, 30]);
    for _ in 0..3 {
        pool.run_all("count", |rank, n| {
            *n += 1 + rank as u64;
            Ok(())
        })
        .expect("run_all");
    }
    assert_eq!(pool.run_on(2, "read", |n| Ok(*n)).expect("run_on"), 9);
    assert_eq!(pool.run_all("read", |_, n| Ok(*n)).expect("run_all"), vec![3, 6, 9, 12]);
}

/// A subset of workers runs a phase (results in the order asked) while a long command started
/// with `start_on` keeps another worker busy; its error names the worker and the phase, and the
/// failure hook hears of it.
#[test]
fn run_some_beside_a_long_command_on_another_worker() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut pool = counter_pool(3);
    let heard = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let h2 = heard.clone();
    pool.set_on_failure(move |why| h2.lock().expect("hook").push(why.to_string()));
    let go = Arc::new(AtomicBool::new(false));
    let g2 = go.clone();
    let mut long = pool
        .start_on(0, "generate", move |n| {
            while !g2.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            *n += 100;
            Err::<(), _>(anyhow::anyhow!("generator gave up"))
        })
        .expect("start_on");
    assert!(!long.is_done());
    // Workers 2 and 1 answer while worker 0 is still busy.
    let got = pool.run_some(&[2, 1], "train", |rank, n| {
        *n += rank as u64;
        Ok(rank)
    });
    assert_eq!(got.expect("run_some"), vec![2, 1]);
    go.store(true, Ordering::SeqCst);
    let e = format!("{:#}", long.wait().unwrap_err());
    assert!(e.contains("worker 0 (cpu:0) failed in phase 'generate'") && e.contains("generator gave up"), "{e}");
    assert_eq!(heard.lock().expect("hook").len(), 1);
    assert_eq!(pool.run_all("read", |_, n| Ok(*n)).expect("run_all"), vec![100, 1, 2]);
    assert!(pool.run_some(&[5], "x", |_, _| Ok(())).unwrap_err().to_string().contains("no worker 5"));
}

#[test]
fn init_runs_on_the_worker_thread_and_its_errors_are_named() {
    let pool = WorkerPool::spawn(names(2), vec![Vec::new(); 2], |rank| {
        Ok((rank, std::thread::current().name().map(str::to_string)))
    })
    .expect("spawn");
    let got = pool.run_all("who", |_, s| Ok(s.clone())).expect("run_all");
    assert_eq!(got, vec![(0, Some("colotrain-worker-0".into())), (1, Some("colotrain-worker-1".into()))]);
    let err = WorkerPool::<()>::spawn(names(3), vec![Vec::new(); 3], |rank| {
        if rank == 1 {
            Err(anyhow!("no such device"))
        } else {
            Ok(())
        }
    })
    .err()
    .expect("init failure");
    assert_eq!(format!("{err:#}"), "worker 1 (cpu:1) failed to initialize: no such device");
    assert!(WorkerPool::spawn(names(2), vec![Vec::new(); 3], |_| Ok(())).is_err(), "core lists must match names");
}

#[test]
fn a_panic_is_named_poisons_only_that_worker_and_never_hangs() {
    within(30, || {
        let pool = counter_pool(3);
        let err = pool
            .run_all("train", |rank, n| {
                *n += 1;
                if rank == 1 {
                    panic!("boom {rank}");
                }
                Ok(())
            })
            .expect_err("rank 1 panicked");
        assert_eq!(err.to_string(), "worker 1 (cpu:1) panicked in phase 'train': boom 1");
        assert_eq!(pool.run_on(0, "eval", |n| Ok(*n)).expect("worker 0 is healthy"), 1);
        let err = pool.run_on(1, "eval", |n| Ok(*n)).expect_err("worker 1 is poisoned");
        assert!(
            err.to_string().starts_with("worker 1 (cpu:1) is poisoned by an earlier panic in phase 'train'"),
            "{err}"
        );
        let err = pool.run_on(2, "eval", |_| -> anyhow::Result<()> { panic!("static message") }).expect_err("panics");
        assert_eq!(err.to_string(), "worker 2 (cpu:2) panicked in phase 'eval': static message");
        let err = pool.run_all("step", |_, n| Ok(*n)).expect_err("two workers are poisoned");
        assert!(
            format!("{err:#}").starts_with("2 of 3 workers failed in phase 'step': worker 1 (cpu:1) is poisoned"),
            "{err:#}"
        );
        assert_eq!(pool.run_on(0, "eval", |n| Ok(*n)).expect("worker 0 is still healthy"), 1);
    });
}

#[test]
fn an_error_names_worker_and_phase() {
    let pool = counter_pool(3);
    let err = pool.run_on(2, "rollout", |_| -> anyhow::Result<()> { Err(anyhow!("bad prompt")) }).expect_err("fails");
    assert_eq!(format!("{err:#}"), "worker 2 (cpu:2) failed in phase 'rollout': bad prompt");
    let err = pool.run_all("grad", |rank, _| if rank == 0 { Ok(()) } else { Err(anyhow!("nan in rank {rank}")) });
    let msg = format!("{:#}", err.expect_err("two ranks fail"));
    assert_eq!(msg, "2 of 3 workers failed in phase 'grad': worker 1 (cpu:1) failed in phase 'grad': nan in rank 1");
    assert!(pool.run_on(3, "x", |_| Ok(())).is_err(), "rank 3 does not exist");
}

#[test]
fn run_all_runs_the_workers_concurrently() {
    within(30, || {
        let pool = counter_pool(3);
        let barrier = Arc::new(Barrier::new(3));
        // Would deadlock if the workers ran one after another.
        let got = pool
            .run_all("meet", move |rank, _| {
                barrier.wait();
                Ok(rank)
            })
            .expect("run_all");
        assert_eq!(got, vec![0, 1, 2]);
    });
}

#[test]
fn a_failing_worker_aborts_the_collective_through_the_hook() {
    within(30, || {
        for panics in [false, true] {
            let c = Arc::new(InProcess::new(3).expect("world 3"));
            let mut pool = counter_pool(3);
            let hook = Arc::clone(&c);
            pool.set_on_failure(move |why| hook.abort(why));
            let cc = Arc::clone(&c);
            let err = pool
                .run_all("step", move |rank, _| {
                    if rank == 1 {
                        // The other ranks are (or will be) waiting for rank 1 in the collective.
                        std::thread::sleep(Duration::from_millis(20));
                        if panics {
                            panic!("device lost");
                        }
                        anyhow::bail!("device lost");
                    }
                    cc.all_reduce_sum_f64(rank, 1.0)
                })
                .expect_err("rank 1 fails");
            let msg = format!("{err:#}");
            assert!(msg.starts_with("3 of 3 workers failed in phase 'step': worker 0 (cpu:0) failed"), "{msg}");
            assert!(msg.contains("collective aborted: worker 1 (cpu:1)") && msg.contains("device lost"), "{msg}");
        }
    });
}

#[test]
fn split_cores_gives_contiguous_shares_and_wraps() {
    let ids: Vec<core_affinity::CoreId> = (0..5).map(|id| core_affinity::CoreId { id }).collect();
    let as_ids = |v: Vec<Vec<core_affinity::CoreId>>| -> Vec<Vec<usize>> {
        v.into_iter().map(|c| c.into_iter().map(|x| x.id).collect()).collect()
    };
    assert_eq!(as_ids(split_core_list(&ids, 2)), vec![vec![0, 1, 2], vec![3, 4]]);
    assert_eq!(as_ids(split_core_list(&ids[..2], 3)), vec![vec![0], vec![1], vec![0]]);
    assert_eq!(as_ids(split_core_list(&[], 2)), vec![Vec::<usize>::new(), Vec::new()]);
    assert_eq!(split_cores(3).len(), 3);
}

#[test]
fn padded_shards_round_trip_and_place_every_shard_at_its_chunk() {
    use super::collective::{pad_shards, padded_chunk, unpad_shards};
    for (total, world) in [(0usize, 1usize), (1, 3), (10, 3), (12, 4), (7, 7), (5, 8)] {
        let c = padded_chunk(total, world);
        assert!(c >= 1 && c * world >= total, "chunk {c} for {total} over {world}");
        let full: Vec<f32> = (0..total).map(|i| i as f32 + 0.5).collect();
        let mut staged = vec![f32::NAN; 3];
        pad_shards(&full, world, c, &mut staged);
        assert_eq!(staged.len(), world * c);
        for r in 0..world {
            let sh = shard_range(total, world, r);
            // The shard at the start of its chunk, zeros after it.
            assert_eq!(&staged[r * c..r * c + sh.len()], &full[sh.clone()], "rank {r} of {world}, total {total}");
            assert!(staged[r * c + sh.len()..(r + 1) * c].iter().all(|&x| x == 0.0));
        }
        let mut back = vec![f32::NAN; total];
        unpad_shards(&staged, world, c, &mut back);
        assert_eq!(back, full);
    }
}
