//! The README's tour of the CLI names subcommands and flags that exist: each
//! `kiln …` line of its "The CLI" block asks that subcommand for `--help`, and
//! every `--flag` on the line must be in it.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use assert_cmd::Command;

/// The ```sh block under the README's "## The CLI".
fn cli_block() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
    let section = readme.split("\n## The CLI\n").nth(1).expect("a \"## The CLI\" section");
    let body = section.split("```sh\n").nth(1).expect("a ```sh block in it");
    body.split("\n```").next().unwrap().lines().map(str::to_string).collect()
}

/// The words before the first flag (the subcommand and its positionals, one
/// of each `a|b` alternative), and every `--flag` on the line, comments aside.
fn parse(line: &str) -> Option<(Vec<String>, Vec<String>)> {
    let code = line.split('#').next().unwrap();
    let mut words = code.split_whitespace().skip_while(|w| w.contains('='));
    if words.next() != Some("kiln") {
        return None;
    }
    let words: Vec<&str> = words.take_while(|w| *w != "--").collect();
    let head = words
        .iter()
        .take_while(|w| !w.starts_with('-') && !w.starts_with('['))
        .map(|w| w.split('|').next().unwrap().to_string())
        .collect();
    let flags = words
        .iter()
        .map(|w| w.trim_start_matches('['))
        .filter(|w| w.starts_with("--"))
        .map(|w| w.split(['=', '|', ']']).next().unwrap().to_string())
        .collect();
    Some((head, flags))
}

#[test]
fn every_flag_in_the_readmes_cli_tour_exists() {
    let lines = cli_block();
    let mut checked = 0;
    for line in &lines {
        let Some((head, flags)) = parse(line) else { continue };
        let out = Command::cargo_bin("kiln").unwrap().args(&head).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "README: `{line}`: `kiln {} --help` failed: {}",
            head.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        for flag in flags {
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "README: `{line}`: no {flag} in `kiln {} --help`:\n{help}",
                head.join(" ")
            );
        }
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} `kiln` lines found in the README's CLI block");
}

/// "Every subcommand that reports takes `--json`": all but `launch`.
#[test]
fn every_reporting_subcommand_takes_json() {
    let cmd = Command::cargo_bin("kiln").unwrap().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&cmd.stdout).to_string();
    let subs: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|s| !["help", "launch"].contains(s))
        .collect();
    assert!(subs.len() >= 5, "{subs:?}");
    for sub in subs {
        // `train` and `cache` take theirs on their subcommands.
        let path: &[&str] = match sub {
            "train" => &["train", "mlp"],
            "cache" => &["cache", "stats"],
            s => &[s][..],
        };
        let out = Command::cargo_bin("kiln").unwrap().args(path).arg("--help").output().unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("--json"), "`kiln {}` has no --json", path.join(" "));
    }
}

#[test]
fn the_line_parser_reads_alternatives_brackets_and_env() {
    let (head, flags) = parse("KILN_CPU_DEVICES=4 kiln cache stats|clear [--json]  # x --not-this").unwrap();
    assert_eq!(head, ["cache", "stats"]);
    assert_eq!(flags, ["--json"]);
    let (head, flags) = parse("kiln launch --nodes 2 -- kiln train mlp").unwrap();
    assert_eq!(head, ["launch"]);
    assert_eq!(flags, ["--nodes"]);
    assert!(parse("benches/device/remat.sh   # kiln x").is_none());
}
