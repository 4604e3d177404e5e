"""Foundation checks: package metadata matches the code, setup.py installs what exists, linters pass."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[2]

# Top-level Python import -> the rosdep key package.xml must list for it.
ROSDEP_KEYS = {
    'rclpy': 'rclpy',
    'hypothesis': 'python3-hypothesis',
    'gemma_spec_msgs': 'gemma_spec_msgs',
    'builtin_interfaces': 'builtin_interfaces',
    'action_msgs': 'action_msgs',
    'unique_identifier_msgs': 'unique_identifier_msgs',
    'rcl_interfaces': 'rcl_interfaces',
    'lifecycle_msgs': 'lifecycle_msgs',
    'psutil': 'python3-psutil',
    'diagnostic_msgs': 'diagnostic_msgs',
    'sensor_msgs': 'sensor_msgs',
    'diagnostic_updater': 'diagnostic_updater',
    'launch': 'launch',
    'launch_ros': 'launch_ros',
    'ament_index_python': 'ament_index_python',
    'rosidl_runtime_py': 'rosidl_runtime_py',
    'torch': 'python3-torch',
    'transformers': 'python3-transformers-pip',
    'safetensors': 'python3-safetensors-pip',
    'tokenizers': 'python3-transformers-pip',
    'numpy': 'python3-numpy',
    'yaml': 'python3-yaml',
    'tqdm': 'python3-tqdm',
    'matplotlib': 'python3-matplotlib',
    'rosbags': 'python3-rosbags-pip',
    'xgrammar': 'python3-xgrammar-pip',
    'jsonschema': 'python3-jsonschema',
    'PIL': 'python3-pil',
}


def package_xml_depends(path):
    root = ElementTree.parse(path).getroot()
    return {element.text for element in root if element.tag.endswith('depend')}


def imported_top_level_modules(paths):
    modules = set()
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split('.')[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split('.')[0])
    return modules - set(sys.stdlib_module_names) - {'gemma_spec_ros'}


def captured_setup_kwargs():
    captured = {}
    original = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        source = (REPO / 'setup.py').read_text()
        exec(compile(source, 'setup.py', 'exec'), {'__name__': '__main__'})
    finally:
        os.chdir(cwd)
        setuptools.setup = original
    return captured


def test_package_xml_lists_every_third_party_import():
    shipped = list((REPO / 'gemma_spec_ros').rglob('*.py')) + list((REPO / 'launch').glob('*.py'))
    imported = imported_top_level_modules(shipped)
    unknown = sorted(imported - set(ROSDEP_KEYS))
    assert not unknown, 'imports with no rosdep key mapping; add them to package.xml and ROSDEP_KEYS: %s' % unknown
    missing = sorted({ROSDEP_KEYS[m] for m in imported} - package_xml_depends(REPO / 'package.xml'))
    assert not missing, 'package.xml lacks dependencies the code imports: %s' % missing


def test_package_xml_names_and_format():
    for path, name in ((REPO / 'package.xml', 'gemma_spec_ros'), (REPO / 'msg/package.xml', 'gemma_spec_msgs')):
        root = ElementTree.parse(path).getroot()
        assert root.get('format') == '3'
        assert root.findtext('name') == name


def test_setup_py_data_files_and_entry_points_exist():
    kwargs = captured_setup_kwargs()
    installed = {}
    for destination, sources in kwargs['data_files']:
        for source in sources:
            assert (REPO / source).is_file(), source
            installed.setdefault(destination, []).append(source)
    assert installed.get('share/gemma_spec_ros/launch'), 'no launch files installed'
    assert 'config/orin.yaml' in installed.get('share/gemma_spec_ros/config', [])
    import importlib
    for spec in kwargs['entry_points']['console_scripts']:
        name, target = (part.strip() for part in spec.split('='))
        module_name, function_name = target.split(':')
        assert callable(getattr(importlib.import_module(module_name), function_name)), spec
    names = {spec.split('=')[0].strip() for spec in kwargs['entry_points']['console_scripts']}
    assert {'gemma_spec_node', 'client', 'diag'} <= names


def test_every_command_has_help():
    from conftest import NO_DIAGNOSTIC_UPDATER

    from gemma_spec_ros.__main__ import COMMANDS
    has_updater = importlib.util.find_spec('diagnostic_updater') is not None
    need_updater = []
    for command in COMMANDS:
        completed = subprocess.run([sys.executable, '-m', 'gemma_spec_ros', command, '--help'],
                                   capture_output=True, text=True, timeout=120, cwd=REPO)
        if not has_updater and "No module named 'diagnostic_updater'" in completed.stderr:
            need_updater.append(command)
            continue
        assert completed.returncode == 0, (command, completed.stderr[-2000:])
        assert 'usage' in completed.stdout.lower(), command
    if need_updater:
        pytest.skip('--help of {}: {}'.format(', '.join(need_updater), NO_DIAGNOSTIC_UPDATER))


def test_ruff_lint_and_docstrings():
    ruff = shutil.which('ruff')
    if ruff is None:
        pytest.fail('ruff is not installed; run scripts/setup.sh')
    completed = subprocess.run([ruff, 'check', 'gemma_spec_ros', 'launch', 'test', 'setup.py'],
                               capture_output=True, text=True, cwd=REPO)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_robot_build_command_finds_both_packages(tmp_path):
    colcon = shutil.which('colcon')
    assert colcon, 'colcon is not installed; run scripts/setup.sh'
    (tmp_path / 'src').mkdir()
    (tmp_path / 'src' / 'gemma_spec_ros').symlink_to(REPO)
    listed = subprocess.run([colcon, 'list', '--names-only', '--base-paths', 'src', 'src/gemma_spec_ros/msg'],
                            capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert sorted(listed) == ['gemma_spec_msgs', 'gemma_spec_ros']


def test_the_robot_install_holds_no_benchmarks_or_training(tmp_path):
    """setup.py builds the robot's package without the lab; the C++ ops of the CPU fast path come along."""
    subprocess.run([sys.executable, 'setup.py', '-q', 'build', '--build-base', str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    built = tmp_path / 'lib' / 'gemma_spec_ros'
    assert sorted(path.name for path in built.iterdir() if path.is_dir()) == ['engine', 'ros', 'tools']
    assert {path.name for path in (built / 'engine' / 'runtime' / 'ops').iterdir()} >= {
        'cpu_ops.py', 'cpu_attention.cpp', 'int8_linear.cpp', 'lane_totals.h'}
    assert not [path for path in built.rglob('*') if 'bench' in path.name or 'train' in path.name]


def test_no_package_folder_holds_more_than_twelve_modules():
    """Each folder is a room that says what it holds (its __init__.py), not a hall of files."""
    crowded = {}
    for init in (REPO / 'gemma_spec_ros').rglob('__init__.py'):
        modules = [path for path in init.parent.glob('*.py') if path.name != '__init__.py']
        if len(modules) > 12:
            crowded[init.parent.relative_to(REPO).as_posix()] = len(modules)
        assert ast.get_docstring(ast.parse(init.read_text())), '{} says nothing of its folder'.format(init)
    assert crowded == {}


def test_engine_modules_stay_small():
    """No engine module over 500 lines, and the decode loop (decoding/engine.py) at most 400."""
    engine = REPO / 'gemma_spec_ros' / 'engine'
    sizes = {path.relative_to(engine).as_posix(): len(path.read_text().splitlines()) for path in engine.rglob('*.py')}
    assert {name: size for name, size in sizes.items() if size > 500} == {}
    assert sizes['decoding/engine.py'] <= 400


def _private_names(tree: ast.Module) -> set[str]:
    """Return the private names a module defines: functions, classes, self. attributes, assignments, imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ('self', 'cls'):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return {name for name in names if name.startswith('_') and not name.startswith('__')}


def test_no_module_reaches_into_another_modules_private_fields():
    """`x._name` only where this module defines _name: others use public methods (a library's privates aside)."""
    trees = {path: ast.parse(path.read_text()) for path in (REPO / 'gemma_spec_ros').rglob('*.py')}
    defined = {path: _private_names(tree) for path, tree in trees.items()}
    ours = set().union(*defined.values())
    reaches = ['{}:{} {}'.format(path.relative_to(REPO), node.lineno, ast.unparse(node))
               for path, tree in trees.items() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in ours and node.attr not in defined[path]]
    assert reaches == []


def test_the_package_imports_have_no_circles():
    """No module reaches itself through its imports (lazy ones count: grimp reads every import statement)."""
    grimp = pytest.importorskip('grimp')
    graph = grimp.build_graph('gemma_spec_ros')
    circles = sorted({tuple(sorted((module, *chain))) for module in graph.modules
                      for imported in graph.find_modules_directly_imported_by(module)
                      if (chain := graph.find_shortest_chain(importer=imported, imported=module))})
    assert circles == []


def test_every_test_module_has_a_tier():
    """Each test module lives in its tier's folder (test/unit, test/engine, ...), which conftest marks it with."""
    from conftest import TIERS, tier_of

    modules = list((REPO / 'test').rglob('test_*.py'))
    assert modules and [path for path in modules if tier_of(path) not in TIERS] == []


def test_layers_are_a_checked_contract():
    """The import contracts in setup.cfg: between the packages and between the engine's parts (architecture.md)."""
    lint = subprocess.run([str(Path(sys.executable).parent / 'lint-imports'), '--no-cache', '--config',
                           str(REPO / 'setup.cfg')],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-2000:]


def test_tools_import_without_torch_or_the_node_internals():
    # a client on a planner's machine needs neither the models nor the node's diagnostic tasks and backends
    code = ('import sys\n'
            'import gemma_spec_ros.tools.bag, gemma_spec_ros.tools.client_cli, gemma_spec_ros.tools.diag_monitor\n'
            'import gemma_spec_ros.tools.demo, gemma_spec_ros.tools.stress\n'
            'import gemma_spec_ros.ros.conversions, gemma_spec_ros.ros.goal_queue\n'
            'unwanted = sorted({"torch", "transformers", "diagnostic_updater", "gemma_spec_ros.ros.diagnostics",\n'
            '                "gemma_spec_ros.engine.backends.vllm"} & set(sys.modules))\n'
            'assert not unwanted, unwanted\n')
    run = subprocess.run([sys.executable, '-X', 'importtime', '-c', code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    imported = {line.rsplit('|', 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith('import time')}
    assert 'gemma_spec_ros.tools.client' in imported and not imported & {'torch', 'transformers'}


@pytest.mark.parametrize(('given', 'expected'), [(None, 'PASSIVE'), ('ACTIVE', 'ACTIVE')])
def test_package_import_sets_a_passive_openmp_wait_policy_unless_one_is_set(given, expected):
    # OpenMP reads the policy when torch loads: the package must set it before, and keep a policy the user chose
    env = {key: value for key, value in os.environ.items() if key != 'OMP_WAIT_POLICY'}
    if given:
        env['OMP_WAIT_POLICY'] = given
    code = ('import os, sys\n'
            'import gemma_spec_ros.engine\n'
            'assert "torch" not in sys.modules\n'
            'print(os.environ["OMP_WAIT_POLICY"])\n')
    run = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == expected
