//! A small persistent pool of worker threads for kernels called many times
//! per model step (one matmul per layer and projection: over a hundred calls
//! per decoded token). Spawning threads per call would cost more than the
//! work; these workers wait for the next job by spinning for a short while,
//! then park until woken.
//!
//! A job's parts are claimed one at a time, by the calling thread and the
//! workers alike, from a counter: whoever is running takes the next part.
//! When the cores are shared (a server's frontend, a client, other
//! processes) and a worker is late to wake or descheduled, the caller goes
//! on with the parts that worker would have taken, instead of waiting for
//! it to be scheduled again. (Splitting the work into more parts than
//! threads, to even out shares further, measured no faster, with or
//! without a busy process beside the engine.)
//!
//! A job may have more parts than threads to run them (a matmul cuts its
//! columns into four parts a thread): `run_parts_on` says how many threads,
//! the caller's included, may take its parts; the other workers sit it out.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks. Calls within one model
/// step come tens of microseconds apart, so spinning keeps the workers hot
/// through a step and lets them sleep between steps.
const SPIN: Duration = Duration::from_micros(50);

/// The most parts one job may have (the claim counter's width).
const MAX_PARTS: usize = 0xffff;

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// The job's epoch (upper 32 bits), its number of parts (16 bits) and
    /// the next unclaimed part (16 bits), changed together atomically.
    state: AtomicU64,
    /// Parts of the current job finished.
    finished: AtomicUsize,
    /// How many threads may take the current job's parts, the dispatching
    /// one included: worker `w` takes part only if `w + 1 < threads`. Set
    /// before the job's epoch is published.
    threads: AtomicUsize,
    job: UnsafeCell<Option<*const Job>>,
    sleeping: Vec<AtomicBool>,
}

fn pack(epoch: u32, parts: usize, next: usize) -> u64 {
    (u64::from(epoch) << 32) | ((parts as u64) << 16) | next as u64
}

fn unpack(state: u64) -> (u32, usize, usize) {
    (
        (state >> 32) as u32,
        ((state >> 16) & 0xffff) as usize,
        (state & 0xffff) as usize,
    )
}

// SAFETY: `job` is written only by the dispatching thread, which holds the
// pool's lock: set before it publishes a new epoch (release), cleared after
// every part of the job has finished (acquire). A thread reads it only
// after claiming an unfinished part of the current epoch, when the
// dispatcher is still waiting and the job alive.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    epoch: u32,
}

fn pool(workers: usize) -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            threads: AtomicUsize::new(usize::MAX),
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
        Mutex::new(Pool {
            shared,
            threads,
            epoch: 0,
        })
    })
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0u32;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let epoch = unpack(shared.state.load(Ordering::Acquire)).0;
            if epoch != seen {
                break epoch;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                // Announce the sleep, then look once more: the dispatcher
                // publishes the epoch before it checks `sleeping` (both
                // sequentially consistent), so one of the two sees the other.
                shared.sleeping[index].store(true, Ordering::SeqCst);
                if unpack(shared.state.load(Ordering::SeqCst)).0 == seen {
                    thread::park();
                }
                shared.sleeping[index].store(false, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        };
        seen = epoch;
        // (the epoch was read with acquire after `threads` was stored)
        if index + 1 < shared.threads.load(Ordering::Relaxed) {
            claim_and_run(shared, epoch);
        }
    }
}

/// Claims and runs parts of the job of `epoch` until none is left.
fn claim_and_run(shared: &Shared, epoch: u32) {
    loop {
        let state = shared.state.load(Ordering::Acquire);
        let (current, parts, next) = unpack(state);
        if current != epoch || next >= parts {
            return;
        }
        if shared
            .state
            .compare_exchange_weak(state, state + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: part `next` of the current job is ours and not
            // finished, so the dispatcher is waiting and the job alive.
            let job = unsafe { (*shared.job.get()).expect("a job with the epoch") };
            unsafe { (*job)(next) };
            shared.finished.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Runs `job(0)`, ..., `job(parts - 1)`, each exactly once, on the calling
/// thread and the pool's workers, and returns when all have finished. A
/// call made while the pool is busy (another thread's job) runs its parts
/// on the calling thread alone.
pub fn run_parts(parts: usize, job: &(dyn Fn(usize) + Sync)) {
    run_parts_on(parts, parts, job);
}

/// `run_parts` on at most `threads` threads, the calling one included (one:
/// every part on the calling thread, in order).
pub fn run_parts_on(threads: usize, parts: usize, job: &(dyn Fn(usize) + Sync)) {
    if parts <= 1 || threads <= 1 {
        (0..parts).for_each(job);
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
    let Ok(mut pool) = pool(workers).try_lock() else {
        (0..parts).for_each(job);
        return;
    };
    for first in (0..parts).step_by(MAX_PARTS) {
        let count = (parts - first).min(MAX_PARTS);
        dispatch(&mut pool, threads, count, &|i| job(first + i));
    }
}

fn dispatch(pool: &mut Pool, threads: usize, parts: usize, job: &(dyn Fn(usize) + Sync)) {
    let shared = Arc::clone(&pool.shared);
    // SAFETY: the job is cleared below, after every part has finished, and
    // read only by threads that claimed a part before then (see `Shared`).
    let erased: *const Job = unsafe { std::mem::transmute(job) };
    unsafe { *shared.job.get() = Some(erased) };
    shared.finished.store(0, Ordering::Relaxed);
    shared.threads.store(threads, Ordering::Relaxed);
    pool.epoch = pool.epoch.wrapping_add(1);
    shared
        .state
        .store(pack(pool.epoch, parts, 0), Ordering::SeqCst);
    for (w, thread) in pool.threads.iter().enumerate().take(threads - 1) {
        if shared.sleeping[w].load(Ordering::SeqCst) {
            thread.unpark();
        }
    }
    claim_and_run(&shared, pool.epoch);
    // Parts still running elsewhere: spin a little, then yield the core (a
    // worker descheduled mid-part may be waiting for this one).
    let mut spins = 0u32;
    while shared.finished.load(Ordering::Acquire) < parts {
        spins = spins.wrapping_add(1);
        if spins < 4096 {
            std::hint::spin_loop();
        } else {
            thread::yield_now();
        }
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
    fn many_parts_each_run_once() {
        // More parts than threads (claimed one at a time), and more than one
        // claim counter holds.
        for parts in [7, 64, MAX_PARTS + 3] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            run_parts(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn a_job_runs_on_at_most_its_threads() {
        // Parts that last long enough for every free worker to take some:
        // one thread keeps them all on the caller, and no job runs on more
        // threads than it allows (the pool's own size where that is less).
        let available = thread::available_parallelism().map_or(1, |n| n.get());
        for threads in [1, 2, 3] {
            let seen = Mutex::new(std::collections::HashSet::new());
            let runs = AtomicUsize::new(0);
            run_parts_on(threads, 24, &|_| {
                seen.lock().unwrap().insert(thread::current().id());
                runs.fetch_add(1, Ordering::Relaxed);
                thread::sleep(Duration::from_millis(2));
            });
            let seen = seen.into_inner().unwrap();
            assert_eq!(runs.load(Ordering::Relaxed), 24);
            assert!(
                seen.len() <= threads,
                "{threads} threads allowed, {} ran",
                seen.len()
            );
            if threads == 1 {
                assert!(seen.contains(&thread::current().id()));
            } else if available > 1 {
                // (another test's job may hold the pool: then all on the caller)
                assert!(!seen.is_empty());
            }
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
