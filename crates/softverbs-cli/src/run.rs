//! `softverbs run -- CMD ARGS…`: runs an unmodified libibverbs program over the softverbs
//! drop-in library (`crates/softverbs-ibverbs`).
//!
//! The loader finds the drop-ins first because CMD runs with `LD_LIBRARY_PATH` starting at a
//! directory that holds `libibverbs.so.1` and `librdmacm.so.1`, links to the built
//! `libibverbs.so` and to the `librdmacm.so` beside it (crate `softverbs-rdmacm`). Device
//! configuration (`SOFTVERBS_DEVICES`) passes through the environment unchanged. The exit
//! status is CMD's (128 + the signal number if a signal ended it).

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Environment variable naming the drop-in library to use.
pub const ENV_LIB: &str = "SOFTVERBS_IBVERBS_LIB";

#[derive(clap::Args)]
pub struct Args {
    /// The drop-in `libibverbs.so` to load (default: $SOFTVERBS_IBVERBS_LIB, else the
    /// `libibverbs.so` that cargo built beside this `softverbs` binary).
    #[arg(long, value_name = "PATH")]
    lib: Option<PathBuf>,
    /// Give the program a networked device (RoCEv2 over UDP between hosts) on this
    /// interface, named `roce0` (`roce1`, ... for more), listed before `softverbs0` so tools
    /// that take the first device use it. Options after the name join the device entry:
    /// `--netdev eth0,drop=1%,fault_seed=7`. May be given more than once.
    #[arg(long, value_name = "IFNAME[,OPTIONS]")]
    netdev: Vec<String>,
    /// The command to run, and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// Finds the drop-in library: `--lib`, `$SOFTVERBS_IBVERBS_LIB`, or next to this binary.
fn find_lib(flag: Option<&Path>) -> crate::Result<PathBuf> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os(ENV_LIB).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or("the softverbs binary has no directory")?;
    // `cargo build` leaves it in target/<profile>/, `cargo test` in target/<profile>/deps/;
    // the newest wins.
    let newest = [dir.to_path_buf(), dir.join("deps")]
        .into_iter()
        .map(|d| d.join("libibverbs.so"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max();
    if let Some((_, p)) = newest {
        return Ok(p);
    }
    Err(format!(
        "cannot find the drop-in libibverbs.so next to {} (build it with \
         `cargo build -p softverbs-ibverbs`, or name it with --lib or ${ENV_LIB})",
        exe.display()
    )
    .into())
}

/// Makes `<dir of lib>/softverbs-ibverbs/libibverbs.so.1` point at `lib`, and
/// `librdmacm.so.1` at the `librdmacm.so` beside `lib` when there is one (atomically, so
/// concurrent runs do not trip over each other), and returns that directory.
fn link_dir(lib: &Path) -> crate::Result<PathBuf> {
    let lib = lib
        .canonicalize()
        .map_err(|e| format!("{}: {e}", lib.display()))?;
    let base = lib.parent().ok_or("library path has no directory")?;
    let cm = base.join("librdmacm.so");
    let links: Vec<(&str, PathBuf)> = [("libibverbs.so.1", lib.clone())]
        .into_iter()
        .chain(cm.is_file().then_some(("librdmacm.so.1", cm)))
        .collect();
    let dir = base.join("softverbs-ibverbs");
    let make = |dir: &Path| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for (name, target) in &links {
            let link = dir.join(name);
            if std::fs::read_link(&link).is_ok_and(|t| t == *target) {
                continue;
            }
            let tmp = dir.join(format!(".{name}.{}", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            std::os::unix::fs::symlink(target, &tmp)?;
            std::fs::rename(&tmp, &link)?;
        }
        Ok(())
    };
    match make(&dir) {
        Ok(()) => Ok(dir),
        Err(_) => {
            // A read-only build directory: use a private one under the temp dir.
            let uid = rustix::process::getuid().as_raw();
            let dir = std::env::temp_dir().join(format!("softverbs-ibverbs-{uid}"));
            make(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            Ok(dir)
        }
    }
}

/// Runs the command; returns its exit status.
/// `SOFTVERBS_DEVICES` with networked devices on `netdevs` first, then the devices the
/// environment had (or the default `softverbs0`).
fn devices_with(netdevs: &[String]) -> String {
    let mut list: Vec<String> = netdevs
        .iter()
        .enumerate()
        .map(|(i, n)| format!("name=roce{i},netdev={n}"))
        .collect();
    match std::env::var(softverbs::ENV_DEVICES) {
        Ok(v) if !v.trim().is_empty() => list.push(v),
        _ => list.push("name=softverbs0,gid=::ffff:127.0.0.1,guid=025056fffe000001".into()),
    }
    list.join(";")
}

pub fn run(args: &Args) -> ExitCode {
    match try_run(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("softverbs: {e}");
            ExitCode::from(127)
        }
    }
}

fn try_run(args: &Args) -> crate::Result<u8> {
    let lib = find_lib(args.lib.as_deref())?;
    if !lib.is_file() {
        return Err(format!("{}: no such library", lib.display()).into());
    }
    let dir = link_dir(&lib)?;
    let mut path = OsString::from(dir.as_os_str());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let (prog, rest) = args.command.split_first().ok_or("no command given")?;
    let mut cmd = std::process::Command::new(prog);
    // The library starts the RoCE engine of networked devices with the executable that
    // `main` put in the environment (this one, unless the environment named another).
    if !args.netdev.is_empty() {
        cmd.env(softverbs::ENV_DEVICES, devices_with(&args.netdev));
    }
    let status = cmd
        .args(rest)
        .env("LD_LIBRARY_PATH", path)
        .status()
        .map_err(|e| format!("cannot run `{}`: {e}", prog.to_string_lossy()))?;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        (None, None) => 1,
    })
}
