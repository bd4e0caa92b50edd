{
  description = "Kvasir: one large language model across a ring of ordinary devices, with no central master";

  # One nixpkgs for every ring member: the NixOS 25.11 release, pinned by the hash of its contents (a changed tarball
  # fails the fetch instead of building something else). Needs Nix >= 2.18 with flakes. Commit flake.lock once it can
  # be generated (`nix flake lock`, needs network); update the pin deliberately, here and in the lock together.
  inputs.nixpkgs = {
    type = "tarball";
    url = "https://github.com/NixOS/nixpkgs/archive/refs/tags/25.11.tar.gz";
    narHash = "sha256-M101xMtWdF1eSD0xhiR8nG8CXRlHmv6V+VoY65Smwf4=";
  };

  outputs =
    { self, nixpkgs }:
    let
      lib = nixpkgs.lib;
      # x86_64-darwin left nixpkgs after 25.11; Kvasir is not tested there.
      systems = [
        "x86_64-linux"
        "aarch64-linux"
        "aarch64-darwin"
      ];
      pyproject = builtins.fromTOML (builtins.readFile ./pyproject.toml);
      # "name>=1.0" -> "name": the dependency list is pyproject's, not a second copy.
      depName = spec: builtins.head (builtins.match "([A-Za-z0-9_.-]+).*" spec);
      deps = pyproject.project.dependencies;
      llamaVersion = lib.removePrefix "llama-cpp-python==" (lib.findFirst (lib.hasPrefix "llama-cpp-python==") "" deps);

      # The same llama.cpp flags as scripts/install.sh (tests/test_flake.py keeps them equal). x86_64: a portable
      # AVX2 build, not -march=native (ggml's native build enables AMX kernels that crash in VMs without AMX state).
      # Elsewhere a store path is shared between machines, so never native either.
      x86Flags = [
        "-DGGML_NATIVE=OFF"
        "-DGGML_AVX=ON"
        "-DGGML_AVX2=ON"
        "-DGGML_FMA=ON"
        "-DGGML_F16C=ON"
        "-DGGML_BMI2=ON"
      ];
      portableFlags = [ "-DGGML_NATIVE=OFF" ];

      forSystems = f: lib.genAttrs systems (system: f system);

      kvasirFor =
        {
          system,
          cudaSupport ? false,
        }:
        let
          pkgs = import nixpkgs {
            inherit system;
            config.allowUnfree = cudaSupport; # the CUDA toolkit
          };
          python = pkgs.python3.override {
            self = python;
            packageOverrides = final: prev: {
              llama-cpp-python = final.callPackage ./nix/llama-cpp-python.nix {
                version = llamaVersion;
                cmakeFlags = if pkgs.stdenv.hostPlatform.isx86_64 then x86Flags else portableFlags;
                inherit cudaSupport;
                inherit (pkgs) cudaPackages;
              };
              # nixpkgs' gguf pulls PySide6 in for its GUI editor; Kvasir only reads and writes files.
              gguf = prev.gguf.overridePythonAttrs (old: {
                dependencies = builtins.filter (d: (d.pname or "") != "pyside6") (old.dependencies or [ ]);
              });
            };
          };
          kvasir = python.pkgs.buildPythonApplication {
            pname = "kvasir";
            version = pyproject.project.version;
            pyproject = true;
            src = lib.fileset.toSource {
              root = ./.;
              fileset = lib.fileset.unions [
                ./pyproject.toml
                ./README.md
                ./LICENSE
                ./kvasir
                ./relay
                ./tui
                ./examples
              ];
            };
            build-system = [ python.pkgs.setuptools ];
            dependencies = map (spec: python.pkgs.${depName spec}) deps;
            # trio>=0.33 is for Android (Termux); the trio of the pinned nixpkgs serves Linux and macOS.
            pythonRelaxDeps = [ "trio" ];
            # The boundary capture callback, compiled here (kvasir/stage/capture.py loads native/capture.so when it
            # is there), so the runtime closure needs no C compiler.
            preBuild = ''
              $CC -O2 -shared -fPIC -o kvasir/stage/native/capture.so kvasir/stage/native/capture.c
            '';
            pythonImportsCheck = [
              "kvasir.cli"
              "kvasir.stage.engine"
            ];
            doCheck = false; # the suite needs tmux, network namespaces and model downloads: CI runs it
            meta = {
              description = pyproject.project.description;
              license = lib.licenses.asl20;
              mainProgram = "kvasir";
            };
          };
        in
        {
          inherit pkgs python kvasir;
        };

      app = k: sub: description: {
        type = "app";
        program = toString (
          k.pkgs.writeShellScript "kvasir-${if sub == "" then "cli" else sub}" ''
            exec ${k.kvasir}/bin/kvasir ${sub} "$@"
          ''
        );
        meta.description = description;
      };
    in
    {
      packages = forSystems (
        system:
        let
          k = kvasirFor { inherit system; };
        in
        {
          default = k.kvasir;
          kvasir = k.kvasir;
        }
        # NVIDIA GPUs (`--gpu-layers -1`): unfree toolkit, not in the binary cache, a long local build.
        // lib.optionalAttrs (lib.hasSuffix "-linux" system) {
          cuda = (kvasirFor {
            inherit system;
            cudaSupport = true;
          }).kvasir;
        }
      );

      apps = forSystems (
        system:
        let
          k = kvasirFor { inherit system; };
        in
        {
          default = app k "" "Kvasir's command line";
          # `nix run .#node -- --manifest ring.toml --rank 1 --model model.gguf`
          node = app k "node" "Run one ring node";
          tui = app k "tui" "Watch a running node and chat with the ring";
          relay = app k "relay" "The NAT-traversal relay";
        }
      );

      checks = forSystems (
        system:
        let
          k = kvasirFor { inherit system; };
        in
        {
          package = k.kvasir;
          cli = k.pkgs.runCommand "kvasir-cli-check" { } ''
            ${k.kvasir}/bin/kvasir --help > $out
          '';
        }
      );

      devShells = forSystems (
        system:
        let
          k = kvasirFor { inherit system; };
        in
        {
          default = k.pkgs.mkShell {
            packages = [
              (k.python.withPackages (
                ps:
                map (spec: ps.${depName spec}) deps
                ++ [
                  ps.pytest
                  ps.pytest-trio
                  ps.hypothesis
                  ps.mypy
                ]
              ))
              k.pkgs.ruff
              k.pkgs.tmux
            ]
            # Network-namespace tests (tests/netns.py) are Linux-only.
            ++ lib.optionals k.pkgs.stdenv.hostPlatform.isLinux [
              k.pkgs.iproute2
              k.pkgs.nftables
            ];
          };
        }
      );
    };
}
