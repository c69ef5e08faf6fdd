//! The command-line options the kernel benches share (`-- --name value`).

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
