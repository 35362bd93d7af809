//! Group commit: commands/s through one hot key whose store append costs a
//! fixed 1 ms whatever its size, with 1, 8, 64 and 256 concurrent callers,
//! batching (`max_batch = 32`) against `max_batch = 1` in the same group.
//! Expected near the limit: commands/s ≈ min(callers, max_batch) / 1 ms.
//!
//! ```text
//! cargo bench --bench group_commit
//! cargo run --release --example lanes_group_commit   # the table, in seconds
//! ```

mod lanes_sim;

use std::time::Duration;

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};

fn group_commit(c: &mut Criterion) {
    let rt = lanes_sim::runtime();
    let mut group = c.benchmark_group("lanes_group_commit");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for callers in [1usize, 8, 64, 256] {
        // One iteration: every caller runs one command.
        group.throughput(Throughput::Elements(callers as u64));
        for (name, max_batch) in [("max_batch=32", 32usize), ("max_batch=1", 1)] {
            group.bench_with_input(BenchmarkId::new(name, callers), &callers, |b, &callers| {
                b.iter_custom(|iters| lanes_sim::run(&rt, callers, max_batch, iters).elapsed)
            });
        }
    }
    group.finish();
}

criterion_group!(benches, group_commit);
criterion_main!(benches);
