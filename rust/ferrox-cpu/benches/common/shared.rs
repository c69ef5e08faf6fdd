//! What the kernel benches share: their command-line options (`-- --name
//! value`) and the median of their samples.

/// The value after `name` on the command line, if it is there.
pub fn option(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

/// The number after `name`, or `default`.
pub fn arg(name: &str, default: usize) -> usize {
    option(name).map_or(default, |v| v.parse().expect("a number"))
}

/// The median, least and greatest of `v`.
pub fn median_min_max(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}
