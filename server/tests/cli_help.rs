//! The production `ds4-server` binary carries no scripted test model: its `--help` offers none of the test-model
//! options, which exist only with the `test-model` feature (the `ds4-test-server` binary the client tests use).

use std::process::Command;

#[test]
fn help_shows_test_model_options_only_in_test_builds() {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-server")).arg("--help").output().expect("run ds4-server --help");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("--port") && help.contains("--kv-disk-dir"), "not the server's help: {help}");
    for flag in ["--fake-model", "--fake-script", "--fake-delay-ms"] {
        assert_eq!(help.contains(flag), cfg!(feature = "test-model"), "{flag} in:\n{help}");
    }
    if !cfg!(feature = "test-model") {
        // Refused as an unknown flag before anything is loaded or served.
        let out = Command::new(env!("CARGO_BIN_EXE_ds4-server")).arg("--fake-model").output().unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("--fake-model"), "clap names the unknown flag");
    }
}
