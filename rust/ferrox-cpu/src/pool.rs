//! A small persistent pool of worker threads for kernels called many times
//! per model step (one matmul per layer and projection: over a hundred calls
//! per decoded token). Spawning threads per call would cost more than the
//! work; these workers wait for the next job by spinning for a short while,
//! then park until woken.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks. Calls within one model
/// step come tens of microseconds apart, so spinning keeps the workers hot
/// through a step and lets them sleep between steps.
const SPIN: Duration = Duration::from_micros(50);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    epoch: AtomicU64,
    done: AtomicUsize,
    job: UnsafeCell<Option<*const Job>>,
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is written only by the dispatching thread, which holds the
// pool's lock, before it publishes a new epoch (release) and after every
// worker has reported the previous job done (acquire).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
}

fn pool(workers: usize) -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            sleeping: (0..workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let threads = (0..workers)
            .map(|w| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("ferrox-cpu-{w}"))
                    .spawn(move || worker(&shared, w))
                    .expect("spawn a kernel worker thread")
                    .thread()
                    .clone()
            })
            .collect();
        Mutex::new(Pool { shared, threads })
    })
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                break epoch;
            }
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && start.elapsed() > SPIN {
                shared.sleeping[index].store(true, Ordering::SeqCst);
                if shared.epoch.load(Ordering::SeqCst) == seen {
                    thread::park();
                }
                shared.sleeping[index].store(false, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        };
        seen = epoch;
        // SAFETY: published before the epoch; the dispatcher keeps it alive
        // until `done` counts this worker.
        let job = unsafe { (*shared.job.get()).expect("a job with the epoch") };
        unsafe { (*job)(index + 1) };
        shared.done.fetch_add(1, Ordering::AcqRel);
    }
}

/// Runs `job(0)`, ..., `job(parts - 1)` in parallel: the calling thread takes
/// part 0, pool workers the rest. Falls back to running every part on the
/// calling thread when the pool is busy (another thread is dispatching).
pub fn run_parts(parts: usize, job: &(dyn Fn(usize) + Sync)) {
    if parts <= 1 {
        if parts == 1 {
            job(0);
        }
        return;
    }
    static WORKERS: OnceLock<usize> = OnceLock::new();
    let workers = *WORKERS.get_or_init(|| {
        thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .saturating_sub(1)
            .max(1)
    });
    let Ok(pool) = pool(workers).try_lock() else {
        (0..parts).for_each(job);
        return;
    };
    let helpers = (parts - 1).min(pool.threads.len());
    if helpers < parts - 1 {
        // More parts than threads: the extra parts run on the caller.
        let run_rest = |i: usize| {
            if i == 0 {
                job(0);
                (helpers + 1..parts).for_each(job);
            } else {
                job(i);
            }
        };
        dispatch(&pool, helpers, &run_rest);
    } else {
        dispatch(&pool, helpers, job);
    }
}

fn dispatch(pool: &Pool, helpers: usize, job: &(dyn Fn(usize) + Sync)) {
    let shared = &pool.shared;
    // Workers beyond `helpers` must not run this job: give them a no-op
    // for their index.
    let bounded = |i: usize| {
        if i <= helpers {
            job(i)
        }
    };
    let bounded: &(dyn Fn(usize) + Sync) = &bounded;
    // SAFETY: the lifetime is erased only for the duration of this call: we
    // wait below until every worker has finished the job.
    let erased: *const Job = unsafe { std::mem::transmute(bounded) };
    unsafe { *shared.job.get() = Some(erased) };
    shared.done.store(0, Ordering::Release);
    shared.epoch.fetch_add(1, Ordering::SeqCst);
    for (w, thread) in pool.threads.iter().enumerate() {
        if shared.sleeping[w].load(Ordering::SeqCst) {
            thread.unpark();
        }
    }
    bounded(0);
    while shared.done.load(Ordering::Acquire) < pool.threads.len() {
        std::hint::spin_loop();
    }
    unsafe { *shared.job.get() = None };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once() {
        for parts in 0..6 {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..200 {
                run_parts(parts, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 200));
        }
    }

    #[test]
    fn workers_wake_after_parking() {
        let hits = AtomicUsize::new(0);
        for _ in 0..3 {
            run_parts(2, &|_| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
            thread::sleep(SPIN * 4);
        }
        assert_eq!(hits.load(Ordering::Relaxed), 6);
    }
}
