"""Cluster launchers: the sbatch script and the Kubeflow PyTorchJob are parsed and their fields that
matter checked (nodes, processes, GPUs, rendezvous, the command); the pod templates load into the
kubernetes client's own models, the whole PyTorchJob into the Kubeflow training SDK's."""

import shlex
import shutil
import subprocess

import pytest
import yaml

from parallel.launch.emit import k8s_manifest, slurm_script
from parallel.launch.torchrun import LaunchArgs, torchrun_command
from parallel.spec.io import load_spec

SPEC = load_spec({"backend": "deepspeed", "shard": "full",
                  "topology": {"nodes": 4, "procs_per_node": 8}})


def test_slurm_script_runs_one_launch_per_node_with_a_rendezvous_on_the_first(tmp_path):
    text = slurm_script(SPEC, "configs/zero3.yaml", ["precision=bf16"], "train.py", ["--steps", "9"],
                        job_name="llama", time="2:00:00", max_restarts=2)
    directives = dict((line[len("#SBATCH --"):].split("=", 1) + [""])[:2]
                      for line in text.splitlines() if line.startswith("#SBATCH --"))
    assert directives == {"job-name": "llama", "nodes": "4", "ntasks-per-node": "1",
                          "cpus-per-task": "64", "gpus-per-node": "8", "time": "2:00:00",
                          "output": "%x-%j.out", "open-mode": "append", "signal": "B:USR1@120",
                          "requeue": ""}
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun
    assert ('polyshard launch --rdzv-endpoint "$head:29500" --max-restarts 2 --set precision=bf16 '
            "configs/zero3.yaml train.py --steps 9") in srun
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0  # valid shell


def test_each_node_runs_torchrun_with_c10d_rendezvous():
    cmd = torchrun_command(SPEC, LaunchArgs(rdzv_endpoint="node0:29500"), "train.py", [])
    assert cmd[cmd.index("--nnodes") + 1] == "4" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d" and "--standalone" not in cmd


def test_pytorchjob_manifest_is_the_training_operators_and_resumes_after_preemption():
    """The whole manifest loads into the Kubeflow training SDK's PyTorchJob model (its pod
    templates into kubernetes' own); checkpoint.dir is a volume every restarted pod mounts,
    /dev/shm is memory, and backoffLimit lets a preempted job come back (0 failed it at the first
    resume)."""
    pytest.importorskip("kubeflow.training")
    from kubeflow.training import ApiClient  # the SDK's client: its models, kubernetes' inside

    spec = load_spec(SPEC, ["checkpoint.dir=/ckpt/run"])
    doc = yaml.safe_load(yaml.safe_dump(k8s_manifest(spec, "configs/zero3.yaml", [], "train.py", [],
                                                     image="reg/polyshard:1", max_restarts=3)))
    job = ApiClient()._ApiClient__deserialize(doc, "KubeflowOrgV1PyTorchJob")
    assert (job.api_version, job.kind) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job.spec.pytorch_replica_specs
    assert replicas["Master"].replicas + replicas["Worker"].replicas == 4
    assert job.spec.nproc_per_node == "8" and job.spec.run_policy.backoff_limit >= 20
    for role in ("Master", "Worker"):
        assert replicas[role].restart_policy == "OnFailure"
        pod = replicas[role].template.spec
        container = pod.containers[0]
        assert container.image == "reg/polyshard:1"
        assert container.resources.limits == {"nvidia.com/gpu": "8"}  # a quantity
        assert container.command[:4] == ["polyshard", "launch", "--rdzv-endpoint",
                                         "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]
        mounts = {m.name: m.mount_path for m in container.volume_mounts}
        assert mounts == {"dshm": "/dev/shm", "checkpoints": "/ckpt/run"}
        volumes = {v.name: v for v in pod.volumes}
        assert volumes["dshm"].empty_dir.medium == "Memory"
        assert volumes["checkpoints"].persistent_volume_claim.claim_name == "polyshard-checkpoints"


def test_tpu_vm_command_runs_on_every_worker_of_a_multi_host_slice():
    """topology.nodes 4: each worker passes its index and worker 0's address (torch_xla's own
    metadata readers) to launch, which needs them with several hosts; ~ expands (it was quoted)."""
    from parallel.launch.emit import tpu_vm_command

    words = shlex.split(tpu_vm_command("c.yaml", ["topology.nodes=4"], "train.py", [], "tpu",
                                       "zone", "~/polyshard", nodes=4))
    remote = words[words.index("--worker=all") + 1].removeprefix("--command=")
    assert remote.startswith("cd ~/polyshard && set -- $(python3 -c ")
    assert "tpu.worker_id(), tpu.get_worker_ips()[0]" in remote
    assert 'launch --node-rank "$1" --rdzv-endpoint "$2:29500"' in remote
    one = tpu_vm_command("c.yaml", [], "train.py", [], "tpu", "zone", "/opt/p")
    assert "--node-rank" not in one and "cd /opt/p && PJRT_DEVICE=TPU nohup polyshard launch" in one
    # detached: it outlives the ssh session, its output in the checkout
    assert one.endswith("> polyshard-$(hostname).log 2>&1 < /dev/null &'"), one


def test_slurm_gives_each_node_task_its_cpus_and_appends_on_requeue():
    text = slurm_script(SPEC, "c.yaml", [], "train.py", [])
    assert "#SBATCH --cpus-per-task=64" in text and "#SBATCH --open-mode=append" in text
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=64" in text
    assert "--cpus-per-task=12" in slurm_script(SPEC, "c.yaml", [], "t.py", [], cpus_per_task=12)


def test_tpu_specs_ask_for_no_gpus():
    spec = load_spec({"backend": "xla_fsdp", "topology": {"nodes": 2, "procs_per_node": 4}})
    assert "gpus-per-node" not in slurm_script(spec, "c.yaml", [], "t.py", [])
    limits = k8s_manifest(spec, "c.yaml", [], "t.py", [], image="i")["spec"][
        "pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]
    assert limits == {"limits": {}}


def test_torchtpu_jobs_run_one_command_on_every_worker_and_ask_for_tpu_chips():
    """topology.device: tpu (TorchTPU): no PJRT_DEVICE, no node rank read per worker (TorchTPU's
    set_tpu_launch_env decides it in `polyshard launch`); GKE pods ask for google.com/tpu chips,
    Slurm for no GPUs."""
    from parallel.launch.emit import tpu_vm_command

    for nodes in (1, 4):
        text = tpu_vm_command("c.yaml", ["topology.device=tpu"], "train.py", [], "tpu", "zone",
                              "/opt/p", nodes=nodes, device="tpu")
        remote = shlex.split(text)[-1].removeprefix("--command=")
        assert remote == ("cd /opt/p && nohup polyshard launch --set topology.device=tpu c.yaml "
                          "train.py > polyshard-$(hostname).log 2>&1 < /dev/null &")
    spec = load_spec({"topology": {"device": "tpu", "nodes": 2, "procs_per_node": 4}})
    assert "gpus-per-node" not in slurm_script(spec, "c.yaml", [], "t.py", [])
    pod = k8s_manifest(spec, "c.yaml", [], "t.py", [], image="i")["spec"][
        "pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert pod["resources"] == {"limits": {"google.com/tpu": 4}}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cli_emits_parseable_files(tmp_path, capsys):
    from parallel.cli.main import main

    assert main(["launch", "--emit", "k8s", "--set", "topology.nodes=3", "configs/zero3.yaml",
                 "train.py"]) == 0
    doc = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
    assert doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert main(["launch", "--emit", "slurm", "configs/zero3.yaml", "train.py"]) == 0
    (tmp_path / "job.sbatch").write_text(capsys.readouterr().out)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0


@pytest.mark.parametrize("env,launcher", [
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1"}, "torchrun"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "n0"}, "slurm"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "0", "LOCAL_RANK": "0"}, "torchrun"),
    ({"PJRT_DEVICE": "CPU"}, "local"),
])
def test_launcher_is_detected_from_the_environment(env, launcher):
    from parallel.dist import launched_world
    from parallel.envinfo import detect_launcher

    assert detect_launcher(env) == launcher
    if launcher == "slurm":
        assert launched_world(env) == (5, 8, 1)


def test_srun_without_a_master_address_is_a_clear_error():
    from parallel.dist import launched_world

    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        launched_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})


FAKE = {"srun": "#!/bin/bash\necho \"$*\" > \"$LOG/srun\"\n{body}\n",
        "scontrol": "#!/bin/bash\necho \"$*\" >> \"$LOG/scontrol\"\n{scontrol}"
                    "[ \"$1\" = show ] && echo node1\nexit 0\n"}


def run_with_fakes(tmp_path, srun_body: str, signal_when: str | None = None, scontrol: str = ""):
    """The emitted script under bash with `srun` and `scontrol` faked on PATH. With signal_when,
    USR1 goes to the script once the fakes have written that file under $LOG (a readiness marker,
    not a fixed delay: a loaded CI box took longer than 1 s to reach srun's trap)."""
    import os
    import signal
    import time

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(parents=True)
    log.mkdir()
    for name, text in FAKE.items():
        (bin_dir / name).write_text(text.format(body=srun_body, scontrol=scontrol))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(slurm_script(SPEC, "c.yaml", [], "train.py", []))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-4]"}
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env)
    if signal_when is not None:
        deadline = time.monotonic() + 30
        while not (log / signal_when).exists() and proc.poll() is None:
            assert time.monotonic() < deadline, f"the fakes never wrote {signal_when}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=60)
    calls = (log / "scontrol").read_text().splitlines() if (log / "scontrol").exists() else []
    return proc.returncode, calls, log


def test_slurm_script_requeues_on_the_preemption_exit_code_only(tmp_path):
    code, calls, _ = run_with_fakes(tmp_path / "a", "exit 85")
    assert code == 85 and "requeue 4242" in calls, calls
    code, calls, _ = run_with_fakes(tmp_path / "b", "exit 1")
    assert code == 1 and not [c for c in calls if c.startswith("requeue")], calls


def test_slurm_script_passes_the_notice_to_srun_and_waits_for_it(tmp_path):
    # the fake srun exits 85 once it receives USR1, as the ranks do after saving
    body = ("trap 'echo got >> \"$LOG/usr1\"; exit 85' USR1\ntouch \"$LOG/srun-ready\"\n"
            "sleep 30 & wait $!")
    code, calls, log = run_with_fakes(tmp_path, body, signal_when="srun-ready")
    assert (log / "usr1").read_text().strip() == "got"
    assert code == 85 and "requeue 4242" in calls, calls


def test_a_notice_before_srun_starts_requeues_without_launching(tmp_path):
    # USR1 while the script is still resolving the head node: before this fix bash's default
    # action for USR1 ended the script (exit 138, no requeue)
    code, calls, log = run_with_fakes(tmp_path, "exit 0", signal_when="in-scontrol",
                                      scontrol='touch "$LOG/in-scontrol"; sleep 1\n')
    assert code == 85 and "requeue 4242" in calls, calls
    assert not (log / "srun").exists(), "srun started after the notice"


def test_pods_get_the_spec_grace_period():
    spec = load_spec({"backend": "fsdp", "topology": {"nodes": 2, "procs_per_node": 8},
                      "checkpoint": {"dir": "/ckpt", "preemption_grace_s": 300}})
    job = k8s_manifest(spec, "c.yaml", [], "train.py", [], image="img")
    pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    assert all(p["terminationGracePeriodSeconds"] == 300 for p in pods), pods


def test_every_emitted_file_carries_the_topology_the_flags_gave(capsys):
    """--nnodes / --nproc reach the launch line, not the header alone (a Slurm file with
    `--nodes=4` in its header started one-node worlds on every node)."""
    from parallel.cli.main import main

    for emit in ("slurm", "k8s", "tpu-vm"):
        assert main(["launch", "--emit", emit, "--nnodes", "4", "--nproc", "8",
                     "configs/zero3.yaml", "train.py"]) == 0
        out = capsys.readouterr().out
        assert "topology.procs_per_node=8" in out and "topology.nodes=4" in out, (emit, out)


def test_a_launch_whose_scheduler_gave_other_nodes_than_the_spec_is_refused():
    from parallel.launch.torchrun import check_allocation
    from parallel.spec.errors import SpecError

    spec = load_spec(SPEC)  # 4 nodes
    for env in ({"SLURM_NNODES": "4"}, {"SLURM_STEP_NUM_NODES": "4", "SLURM_NNODES": "9"},
                {"PET_NNODES": "4"}, {"PET_NNODES": "1:4"}, {}):
        check_allocation(spec, env)
    for env, named in (({"SLURM_NNODES": "2"}, "SLURM_NNODES=2"), ({"PET_NNODES": "2"},
                       "PET_NNODES=2"), ({"TPU_WORKER_HOSTNAMES": "a,b"}, "TPU_WORKER_HOSTNAMES")):
        with pytest.raises(SpecError) as err:
            check_allocation(spec, env)
        (path, message), = err.value.problems
        assert path == "topology.nodes" and named in message and "set topology.nodes: 2" in message


def test_k8s_emits_the_checkpoint_claim_and_setup_and_workdir_reach_every_file(capsys):
    from parallel.cli.main import main

    args = ["--setup", "source /opt/venv/bin/activate", "--set", "checkpoint.dir=/ckpt/run"]
    assert main(["launch", "--emit", "k8s", "--workdir", "/work", "--pvc-size", "2Ti", *args,
                 "configs/zero3.yaml", "train.py"]) == 0
    claim, job = yaml.safe_load_all(capsys.readouterr().out)
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == [
        "ReadWriteMany"] and claim["spec"]["resources"]["requests"]["storage"] == "2Ti"
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    container = pod["containers"][0]
    assert container["workingDir"] == "/work" and container["command"][:2] == ["bash", "-c"]
    assert container["command"][2].startswith("source /opt/venv/bin/activate && exec polyshard "
                                              "launch --rdzv-endpoint '$(PET_MASTER_ADDR)")
    assert main(["launch", "--emit", "slurm", *args, "configs/zero3.yaml", "train.py"]) == 0
    script = capsys.readouterr().out
    assert script.index("source /opt/venv/bin/activate") < script.index("srun --kill")
    assert main(["launch", "--emit", "tpu-vm", *args, "configs/xla-v1-tpu.yaml", "train.py"]) == 0
    assert "cd ~/polyshard && source /opt/venv/bin/activate && PJRT_DEVICE=TPU nohup polyshard " \
        "launch" in capsys.readouterr().out


def test_polyshard_flags_after_the_script_are_named(capsys):
    """Everything after the script is the script's (argparse.REMAINDER): a --set there is said."""
    from parallel.cli.main import main

    assert main(["launch", "--emit", "slurm", "configs/zero3.yaml", "train.py", "--set",
                 "backend=fsdp", "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert "polyshard: --set comes after the script, so it goes to train.py" in err, err
