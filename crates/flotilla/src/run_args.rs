//! The arguments of a run (`flotilla train | launch | config | compare`): the config file and
//! one flag per config key that declares one in [`keys::KEYS`] — its long and short name, help
//! and value type come from there, so the keys, their aliases, environment names and flags are
//! declared in one place. clap's builder makes the arguments from the table (its derive would
//! declare the flags a second time); [`RunArgs`] implements [`Args`] so the commands' derived
//! arguments flatten it as before.

use std::path::PathBuf;

use clap::builder::ValueParser;
use clap::error::ErrorKind;
use clap::{Arg, ArgAction, ArgMatches, Args, FromArgMatches, value_parser};
use flotilla_train::config::keys::{self, Flag, Key, Kind};
use serde_json::Value;

/// A config file and the flags that override it: one flag per key that declares one in
/// [`keys::KEYS`], with the help and value type declared there (so `--help` lists them all,
/// and a value of the wrong type is refused as the command line is read).
#[derive(Debug, Clone, Default)]
pub struct RunArgs {
    /// YAML config file (every key optional; defaults train LeNet-5 on data/mnist with 2 ranks).
    pub config: Option<PathBuf>,
    /// The flags given, in the order of [`keys::KEYS`]: each flag's long name and its value.
    pub flags: Vec<(&'static str, Value)>,
}

impl RunArgs {
    /// Whether `--<long>` was given.
    pub fn given(&self, long: &str) -> bool {
        self.flags.iter().any(|(l, _)| *l == long)
    }
}

/// The id of the config file's argument (the flags' ids are their keys' paths).
const CONFIG_ARG: &str = "config";

impl Args for RunArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let config = Arg::new(CONFIG_ARG)
            .value_name("CONFIG")
            .value_parser(value_parser!(PathBuf))
            .help(
                "YAML config file (every key optional; defaults train LeNet-5 on data/mnist \
                 with 2 ranks)",
            );
        keys::flags().fold(cmd.arg(config), |cmd, (key, flag)| {
            cmd.arg(flag_arg(key, &flag))
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for RunArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Vec::new();
        for (key, flag) in keys::flags() {
            if let Some(value) = flag_value(m, key.path, flag.kind)? {
                flags.push((flag.long, value));
            }
        }
        Ok(RunArgs {
            config: m
                .try_get_one::<PathBuf>(CONFIG_ARG)
                .map_err(misread)?
                .cloned(),
            flags,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// The clap argument of a key's flag.
fn flag_arg(key: &Key, flag: &Flag) -> Arg {
    let arg = Arg::new(key.path).long(flag.long).help(flag.help);
    let arg = match flag.short {
        Some(short) => arg.short(short),
        None => arg,
    };
    let parser: ValueParser = match flag.kind {
        Kind::Switch => return arg.action(ArgAction::SetTrue),
        Kind::SwitchOff => return arg.action(ArgAction::SetTrue),
        Kind::Text => value_parser!(String),
        Kind::Path => value_parser!(PathBuf),
        Kind::U16 => value_parser!(u16).into(),
        Kind::U32 => value_parser!(u32).into(),
        Kind::U64 => value_parser!(u64).into(),
        Kind::Usize => value_parser!(usize).into(),
        Kind::F64 => ValueParser::new(flotilla_train::config::sources::finite_number),
    };
    arg.value_name(flag.value_name)
        .action(ArgAction::Set)
        .value_parser(parser)
}

/// The value of the flag with this id, if given (a switch: only when on).
fn flag_value(m: &ArgMatches, id: &str, kind: Kind) -> Result<Option<Value>, clap::Error> {
    match kind {
        Kind::Switch => {
            let on = m.try_get_one::<bool>(id).map_err(misread)?;
            Ok(on.copied().filter(|on| *on).map(Value::Bool))
        }
        Kind::SwitchOff => {
            let given = m.try_get_one::<bool>(id).map_err(misread)?;
            Ok(given.copied().filter(|g| *g).map(|_| Value::Bool(false)))
        }
        Kind::Text => one::<String>(m, id),
        Kind::Path => path(m, id),
        Kind::U16 => one::<u16>(m, id),
        Kind::U32 => one::<u32>(m, id),
        Kind::U64 => one::<u64>(m, id),
        Kind::Usize => one::<usize>(m, id),
        Kind::F64 => one::<f64>(m, id),
    }
}

/// The value of argument `id`, parsed as a `T`, as JSON.
fn one<T>(m: &ArgMatches, id: &str) -> Result<Option<Value>, clap::Error>
where
    T: Clone + Send + Sync + Into<Value> + 'static,
{
    Ok(m.try_get_one::<T>(id)
        .map_err(misread)?
        .cloned()
        .map(Into::into))
}

/// The path of argument `id`, as JSON text (a config holds paths as text).
fn path(m: &ArgMatches, id: &str) -> Result<Option<Value>, clap::Error> {
    let Some(p) = m.try_get_one::<PathBuf>(id).map_err(misread)? else {
        return Ok(None);
    };
    match p.to_str() {
        Some(text) => Ok(Some(Value::from(text))),
        None => Err(clap::Error::raw(
            ErrorKind::InvalidUtf8,
            format!("{}: not valid UTF-8\n", p.display()),
        )),
    }
}

/// An argument read as another type than it was declared with.
fn misread(e: clap::parser::MatchesError) -> clap::Error {
    clap::Error::raw(ErrorKind::ArgumentConflict, format!("{e}\n"))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};
    use flotilla_train::TrainConfig;
    use serde_json::json;

    use super::*;
    use crate::cli::{Cli, Command};

    /// The run arguments of `flotilla <args>`.
    fn run_args(args: &[&str]) -> RunArgs {
        let argv = std::iter::once("flotilla").chain(args.iter().copied());
        match Cli::try_parse_from(argv).expect("parses").command {
            Command::Config(run) => run,
            Command::Train(a) => a.run,
            Command::Launch(a) => a.run,
            other => panic!("not a run: {other:?}"),
        }
    }

    #[test]
    fn every_flag_is_documented_in_every_run_command() {
        let mut cli = Cli::command();
        for name in ["train", "launch", "config", "compare"] {
            let command = cli.find_subcommand_mut(name).expect(name);
            let help = command.render_long_help().to_string();
            for (_, f) in keys::flags() {
                let spelled = match f.kind {
                    Kind::Switch | Kind::SwitchOff => format!("--{}\n", f.long),
                    _ => format!("--{} <{}>\n", f.long, f.value_name),
                };
                assert!(help.contains(&spelled), "{name}: {spelled}");
                assert!(help.contains(f.help), "{name}: {}", f.help);
            }
            assert!(help.contains("-n, --world-size <WORLD_SIZE>"), "{help}");
            assert!(help.contains("[CONFIG]"), "{help}");
        }
    }

    #[test]
    fn every_flag_sets_its_key_and_the_provenance_names_it() {
        let defaults = serde_json::to_value(TrainConfig::default()).expect("json");
        let mut argv = vec!["config".to_string()];
        let mut want = Vec::new();
        for (k, f) in keys::flags() {
            argv.push(format!("--{}", f.long));
            let value = match f.kind {
                Kind::Switch => json!(true),
                Kind::SwitchOff => json!(false),
                Kind::Text => defaults[k.section()][k.field()].clone(),
                Kind::Path => json!("some/where"),
                Kind::U16 => json!(4321),
                Kind::U32 => json!(3),
                Kind::U64 => json!(11),
                Kind::Usize => json!(5),
                Kind::F64 => json!(2.5),
            };
            match &value {
                Value::Bool(_) => {}
                Value::String(text) => argv.push(text.clone()),
                v => argv.push(v.to_string()),
            }
            want.push((k.path, f.long, value));
        }
        let run = run_args(&argv.iter().map(String::as_str).collect::<Vec<_>>());
        let p = crate::settings::sources(&run, false)
            .and_then(|s| Ok(s.provenance()?))
            .expect("provenance");
        for (path, long, value) in want {
            assert!(run.given(long), "--{long}");
            let got = p.iter().find(|p| p.path == path).expect(path);
            assert_eq!(got.source, format!("flag --{long}"));
            let shown: Value = serde_json::from_str(&got.value).expect("json");
            assert_eq!(shown, value, "{path}");
        }
    }

    #[test]
    fn short_names_the_config_file_and_refused_values() {
        let run = run_args(&[
            "launch",
            "-n",
            "3",
            "--master-port",
            "5",
            "--resume",
            "r.yaml",
        ]);
        assert_eq!(run.config, Some(PathBuf::from("r.yaml")));
        let given = [
            ("resume", json!(true)),
            ("world-size", json!(3)),
            ("master-port", json!(5)),
        ];
        assert_eq!(run.flags, given);
        assert!(run.given("master-port") && !run.given("master-addr"));
        assert!(run_args(&["train"]).flags.is_empty());
        let refused: [(&[&str], ErrorKind, &str); 3] = [
            (
                &["config", "--epochs", "many"],
                ErrorKind::ValueValidation,
                "--epochs <EPOCHS>",
            ),
            (
                &["config", "--master-port", "70000"],
                ErrorKind::ValueValidation,
                "--master-port <MASTER_PORT>",
            ),
            (
                &["config", "--lr", "1", "--lr", "2"],
                ErrorKind::ArgumentConflict,
                "--lr <LR>",
            ),
        ];
        for (args, kind, shown) in refused {
            let argv = std::iter::once("flotilla").chain(args.iter().copied());
            let e = Cli::try_parse_from(argv).expect_err("refused");
            assert_eq!(e.kind(), kind, "{e}");
            assert!(e.to_string().contains(shown), "{e}");
        }
    }
}
