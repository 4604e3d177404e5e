"""
config/sros2_policy.xml, the node's SROS2 policy, against sros2's policy schema and the endpoints the node opens.

The enclave itself cannot run here: the Fast DDS of the PyPI ROS wheels is built without DDS Security
(docs/security.md). What this module checks instead:

- Schema. The policy is valid against sros2's policy schema, test/data/sros2_policy.xsd (copied from ros2/sros2
  0.13.0, the Jazzy release; sros2 is not installed here). sros2 validates with lxml, and neither lxml nor
  xmlschema is in the project's environment, so ``PolicySchema`` reads the XSD with ElementTree and checks the
  policy against what it declares: content models (sequence, choice, minOccurs, maxOccurs), required, fixed and
  undeclared attributes, enumerations, no stray text. It interprets the constructs this XSD uses and refuses one it
  does not know, so that a new schema cannot pass unread. Where lxml is importable, its XMLSchema validates the
  policy too (xml.xsd, which the schema imports from the web, is answered by a local stub: no network).
- Grants. The node runs in its own process as on a robot, with ``--enclave /gemma_spec`` on the tiny random models,
  and a probe node lists its endpoints through rclpy's graph API while it is unconfigured and again once it is
  active (configured and activated through its own lifecycle services). Each endpoint must be granted and the
  policy must grant nothing else. "Granted" means what sros2 makes of the policy: its permissions.xsl
  (sros2/policy/templates/dds/permissions.xsl) turns every grant into DDS topic names, rt<name> for a topic,
  rq<name>Request and rr<name>Reply for a service, and for an action its three services and two topics under
  <name>/_action/ (so an action is granted as a unit); deny rules come first, and the default is DENY. The node's
  endpoints are turned into the same DDS names as the RMW does, so both sides meet on what DDS enforces.
- Negative checks: a policy with a grant taken away, denied or added is caught, and so are invalid policies.
"""

import copy
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, TEST_COMPILE

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / 'config' / 'sros2_policy.xml'
SCHEMA = REPO / 'test' / 'data' / 'sros2_policy.xsd'
ENCLAVE = '/gemma_spec'
DOMAIN_ID = 11 + (os.getpid() + 71) % 80

XS = '{http://www.w3.org/2001/XMLSchema}'
XML_BASE = '{http://www.w3.org/XML/1998/namespace}base'
XML_XSD_URL = 'http://www.w3.org/2001/03/xml.xsd'
XML_XSD_STUB = ('<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema" '
                'targetNamespace="http://www.w3.org/XML/1998/namespace">'
                '<xs:attribute name="base" type="xs:anyURI"/></xs:schema>')
SCHEMA_CONSTRUCTS = {XS + name for name in ('schema', 'import', 'element', 'complexType', 'sequence', 'choice',
                                            'attribute', 'simpleType', 'restriction', 'enumeration')}
BUILTIN_TYPES = {'xs:string', 'xs:anyURI'}
HAVE_LXML = importlib.util.find_spec('lxml') is not None

ACTION_SERVICES = ('cancel_goal', 'get_result', 'send_goal')
ACTION_TOPICS = ('feedback', 'status')
RULES = ('ALLOW', 'DENY')


# ---- sros2's policy schema, read with ElementTree ----------------------------------------------------------------

class PolicySchema:
    """The constructs of sros2's policy.xsd, interpreted: ``errors(root)`` lists what the document breaks."""

    def __init__(self, path: Path):
        root = ElementTree.parse(path).getroot()
        unknown = {element.tag for element in root.iter()} - SCHEMA_CONSTRUCTS
        assert not unknown, 'the schema uses constructs PolicySchema does not interpret: {}'.format(unknown)
        self.elements = {e.get('name'): e.get('type') for e in root.findall(XS + 'element')}
        self.complex_types = {e.get('name'): e for e in root.findall(XS + 'complexType')}
        self.simple_types = {e.get('name'): e for e in root.findall(XS + 'simpleType')}

    def errors(self, root) -> list[str]:
        found = []
        if root.tag not in self.elements:
            return ['<{}> is not an element the schema declares at the top'.format(root.tag)]
        self._element(root, self.elements[root.tag], '/' + root.tag, found)
        return found

    def _element(self, element, type_name, path, found):
        if type_name == 'xs:anyType':
            return
        if type_name not in self.complex_types:
            if len(element) or element.attrib:
                found.append('{}: simple content expected (no child elements, no attributes)'.format(path))
            self._value(type_name, (element.text or '').strip(), path, found)
            return
        declared = self.complex_types[type_name]
        self._attributes(element, declared, path, found)
        if (element.text or '').strip() or any((child.tail or '').strip() for child in element):
            found.append('{}: text is not allowed here'.format(path))
        particles = [p for p in declared if p.tag in (XS + 'sequence', XS + 'choice')]
        children = list(element)
        ends = self._match(particles[0], children, 0) if particles else {0}
        if len(children) not in ends:
            found.append('{}: children {} do not match the content model of {}'.format(
                path, [child.tag for child in children], type_name))
        child_types = {e.get('name'): e.get('type') for e in declared.iter(XS + 'element')}
        for index, child in enumerate(children):
            if child.tag in child_types:
                self._element(child, child_types[child.tag], '{}/{}[{}]'.format(path, child.tag, index), found)

    def _attributes(self, element, declared, path, found):
        attributes = {}
        for attribute in declared.findall(XS + 'attribute'):
            if attribute.get('ref') == 'xml:base':
                attributes[XML_BASE] = ('xs:anyURI', 'optional', None)
            else:
                attributes[attribute.get('name')] = (attribute.get('type'), attribute.get('use', 'optional'),
                                                     attribute.get('fixed'))
        for name in element.attrib:
            if name not in attributes:
                found.append('{}: attribute {} is not declared'.format(path, name))
        for name, (type_name, use, fixed) in attributes.items():
            value = element.get(name)
            if value is None:
                if use == 'required':
                    found.append('{}: attribute {} is required'.format(path, name))
                continue
            if fixed is not None and value != fixed:
                found.append('{}: attribute {} must be {!r}, not {!r}'.format(path, name, fixed, value))
            self._value(type_name, value, '{}/@{}'.format(path, name), found)

    def _value(self, type_name, value, path, found):
        if type_name in BUILTIN_TYPES:
            return
        restriction = self.simple_types[type_name].find(XS + 'restriction')
        self._value(restriction.get('base'), value, path, found)
        allowed = [e.get('value') for e in restriction.findall(XS + 'enumeration')]
        if allowed and value not in allowed:
            found.append('{}: {!r} is not one of {}'.format(path, value, allowed))

    def _match(self, particle, children, position) -> set[int]:
        """Return the positions in children where particle (minOccurs..maxOccurs times) can end, from position."""
        low = int(particle.get('minOccurs', '1'))
        high = particle.get('maxOccurs', '1')
        high = math.inf if high == 'unbounded' else int(high)
        reached = {position} if low == 0 else set()
        frontier, count = {position}, 0
        while frontier and count < high:
            count += 1
            ends = set().union(*(self._once(particle, children, start) for start in frontier))
            frontier = ends if count < low else ends - reached
            if count >= low:
                reached |= ends
        return reached

    def _once(self, particle, children, position) -> set[int]:
        if particle.tag == XS + 'element':
            matches = position < len(children) and children[position].tag == particle.get('name')
            return {position + 1} if matches else set()
        items = [p for p in particle if p.tag in (XS + 'element', XS + 'sequence', XS + 'choice')]
        if particle.tag == XS + 'choice':
            return set().union(*(self._match(item, children, position) for item in items))
        positions = {position}
        for item in items:
            positions = set().union(*(self._match(item, children, start) for start in positions))
        return positions


def lxml_errors(policy_text: str) -> list[str]:
    """Validate with lxml's XMLSchema as sros2 does (after XInclude); xml.xsd comes from a local stub."""
    from lxml import etree

    class XmlNamespaceSchema(etree.Resolver):
        def resolve(self, url, public_id, context):
            return self.resolve_string(XML_XSD_STUB, context) if url == XML_XSD_URL else None

    parser = etree.XMLParser(no_network=True)
    parser.resolvers.add(XmlNamespaceSchema())
    schema = etree.XMLSchema(etree.parse(str(SCHEMA), parser))
    document = etree.ElementTree(etree.fromstring(policy_text.encode()))
    document.xinclude()
    return [] if schema.validate(document) else [str(error) for error in schema.error_log]


# ---- what sros2 grants, and what the node needs, as DDS topic names ------------------------------------------------

def _service(name, server):
    request, reply = ('rq{}Request'.format(name), 'rr{}Reply'.format(name))
    return {('publish', reply), ('subscribe', request)} if server else {('publish', request), ('subscribe', reply)}


def _action(name, server):
    names = set().union(*(_service('{}/_action/{}'.format(name, service), server) for service in ACTION_SERVICES))
    return names | {('publish' if server else 'subscribe', 'rt{}/_action/{}'.format(name, topic))
                    for topic in ACTION_TOPICS}


# the policy's permission (element, attribute) -> the (direction, DDS topic) set of one resolved name
PERMISSIONS = {
    ('topics', 'publish'): lambda name: {('publish', 'rt' + name)},
    ('topics', 'subscribe'): lambda name: {('subscribe', 'rt' + name)},
    ('services', 'reply'): lambda name: _service(name, server=True),
    ('services', 'request'): lambda name: _service(name, server=False),
    ('actions', 'execute'): lambda name: _action(name, server=True),
    ('actions', 'call'): lambda name: _action(name, server=False),
}


def resolve(expression, namespace, node):
    """Resolve a policy name as sros2's permissions.xsl does: absolute, private (~) or relative to the namespace."""
    if expression.startswith('/'):
        return expression
    prefix = namespace if namespace.endswith('/') else namespace + '/'
    return prefix + node + expression[1:] if expression.startswith('~') else prefix + expression


class Grants:
    """The allow and deny rules sros2 writes into the enclave's DDS permissions (default DENY)."""

    def __init__(self, policy_root, enclave=ENCLAVE):
        matching = [e for e in policy_root.iter('enclave') if e.get('path') == enclave]
        assert len(matching) == 1, 'the policy has {} enclaves {}'.format(len(matching), enclave)
        self.rules = {rule: set() for rule in RULES}
        self.profiles = set()
        for profile in matching[0].iter('profile'):
            namespace, node = profile.get('ns'), profile.get('node')
            self.profiles.add((namespace, node))
            for permission in profile:
                for attribute, rule in permission.attrib.items():
                    if rule not in RULES:
                        continue
                    for expression in permission:
                        name = resolve((expression.text or '').strip(), namespace, node)
                        self.rules[rule] |= PERMISSIONS[permission.tag, attribute](name)

    def grants(self, direction, topic) -> bool:
        def matches(rule):
            return any(d == direction and fnmatchcase(topic, pattern) for d, pattern in self.rules[rule])
        return not matches('DENY') and matches('ALLOW')


def needed(endpoints) -> dict[tuple[str, str], set]:
    """(kind, ROS name) of each endpoint -> the (direction, DDS topic) set it needs, as the RMW names them."""
    needs = {}
    for name in endpoints['publishers']:
        needs['publisher', name] = {('publish', 'rt' + name)}
    for name in endpoints['subscribers']:
        needs['subscriber', name] = {('subscribe', 'rt' + name)}
    for name in endpoints['services']:
        needs['service', name] = _service(name, server=True)
    for name in endpoints['clients']:
        needs['client', name] = _service(name, server=False)
    return needs


def ungranted(grants, endpoints) -> list[tuple[str, str]]:
    return sorted(endpoint for endpoint, topics in needed(endpoints).items()
                  if not all(grants.grants(*topic) for topic in topics))


def unneeded(grants, endpoints) -> list[tuple[str, str]]:
    used = set().union(*needed(endpoints).values())
    return sorted(grants.rules['ALLOW'] - used)


def actions_of(endpoints) -> dict[str, set[str]]:
    """Map each action name to the parts of it the node serves (send_goal, ..., status), from hidden endpoints."""
    parts = {}
    for name in endpoints['services'] | endpoints['publishers']:
        if '/_action/' in name:
            action, part = name.split('/_action/')
            parts.setdefault(action, set()).add(part)
    return parts


# ---- the node in its own process, and its endpoints through the graph API -------------------------------------------

def list_endpoints(probe, process, node, namespace, timeout=20.0) -> dict[str, frozenset]:
    """Return the node's endpoints once discovery has settled: the same listing twice, a second apart."""
    from rclpy.node import NodeNameNonExistentError

    getters = {'publishers': probe.get_publisher_names_and_types_by_node,
               'subscribers': probe.get_subscriber_names_and_types_by_node,
               'services': probe.get_service_names_and_types_by_node,
               'clients': probe.get_client_names_and_types_by_node}
    deadline, previous = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        assert process.poll() is None, 'the node exited with code {}'.format(process.returncode)
        try:
            current = {kind: frozenset(name for name, _ in get(node, namespace)) for kind, get in getters.items()}
        except NodeNameNonExistentError:
            current = None
        if current is not None and current == previous and current['services']:
            return current
        previous = current
        time.sleep(1.0)
    raise AssertionError('the endpoints of {} did not settle within {} s: {}'.format(node, timeout, previous))


def call(probe, executor, service_type, name, request, timeout=120.0):
    client = probe.create_client(service_type, name)
    try:
        assert client.wait_for_service(timeout_sec=20.0), 'no service ' + name
        future = client.call_async(request)
        executor.spin_until_future_complete(future, timeout_sec=timeout)
        assert future.done(), '{} did not answer within {} s'.format(name, timeout)
        return future.result()
    finally:
        probe.destroy_client(client)


@pytest.fixture(scope='module')
def listed(context, tiny_models):
    """Run the node in the enclave; return its endpoints unconfigured and active, and the nodes of the enclave."""
    pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)
    import rclpy
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState, GetState
    from rclpy.executors import SingleThreadedExecutor

    namespace, node_name = '/', 'gemma_spec'
    params = {'lifecycle.autostart': 'false', 'engine.target_path': tiny_models.target,
              'engine.assistant_path': tiny_models.assistant, 'engine.draft_model_path': tiny_models.draft,
              'engine.drafter': 'ngram', 'engine.device': 'cpu', 'engine.dtype': 'float32',
              'engine.compile': TEST_COMPILE, 'engine.num_threads': '1'}
    arguments = ['--enclave', ENCLAVE] + [arg for k, v in params.items() for arg in ('-p', '{}:={}'.format(k, v))]
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
               PYTHONUNBUFFERED='1')
    probe = rclpy.create_node('sros2_policy_probe', context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(probe)
    fqn = namespace.rstrip('/') + '/' + node_name
    process = subprocess.Popen([sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args', *arguments], env=env,
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        unconfigured = list_endpoints(probe, process, node_name, namespace)
        enclaves = {(name, ns) for name, ns, enclave in probe.get_node_names_and_namespaces_with_enclaves()
                    if enclave == ENCLAVE}
        for transition in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
            answer = call(probe, executor, ChangeState, fqn + '/change_state',
                          ChangeState.Request(transition=Transition(id=transition)))
            assert answer.success, 'transition {} failed'.format(transition)
        state = call(probe, executor, GetState, fqn + '/get_state', GetState.Request()).current_state.label
        assert state == 'active', state
        active = list_endpoints(probe, process, node_name, namespace)
        yield {'unconfigured': unconfigured, 'active': active, 'enclave_nodes': enclaves}
    finally:
        executor.shutdown()
        probe.destroy_node()
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        print(output[-4000:])


def all_endpoints(listed) -> dict[str, frozenset]:
    return {kind: listed['unconfigured'][kind] | listed['active'][kind] for kind in listed['active']}


def policy_root():
    return ElementTree.parse(POLICY).getroot()


# ---- the tests ------------------------------------------------------------------------------------------------------

def test_the_policy_is_valid_against_sros2s_schema():
    assert PolicySchema(SCHEMA).errors(policy_root()) == []


@pytest.mark.skipif(not HAVE_LXML, reason='lxml is not installed: PolicySchema alone validates the policy')
def test_lxml_agrees_that_the_policy_is_valid():
    assert lxml_errors(POLICY.read_text()) == []


INVALID = {   # what to replace in the policy (the first occurrence) -> a document the schema refuses
    'a version other than the fixed 0.2.0': ('<policy version="0.2.0">', '<policy version="0.3.0">'),
    'a rule other than ALLOW or DENY': ('<actions execute="ALLOW">', '<actions execute="YES">'),
    'a profile without its node attribute': ('<profile ns="/" node="gemma_spec">', '<profile ns="/">'),
    'an attribute the list does not declare': ('<actions execute="ALLOW">', '<actions reply="ALLOW">'),
    'an empty list': ('<topic>/diagnostics</topic>', ''),
    'an element the schema does not know': ('<topics publish="ALLOW">', '<parameters/><topics publish="ALLOW">'),
    'a service in a topic list': ('<topic>/diagnostics</topic>', '<service>/diagnostics</service>'),
    'profiles without a profile': ('<profiles>', '<profiles/><profiles>'),
}


@pytest.mark.parametrize('case', INVALID)
def test_the_schema_refuses_an_invalid_policy(case):
    old, new = INVALID[case]
    text = POLICY.read_text()
    assert old in text
    broken = text.replace(old, new, 1)
    assert PolicySchema(SCHEMA).errors(ElementTree.fromstring(broken)), case
    if HAVE_LXML:
        assert lxml_errors(broken), case


def test_the_policy_uses_explicit_names_only():
    names = [element.text for element in policy_root().iter() if element.tag in ('topic', 'service', 'action')]
    assert names and not [name for name in names if any(c in name for c in '*?[')], names


def test_the_enclave_holds_the_node_and_only_the_node(listed):
    """The participant started with --enclave /gemma_spec hosts exactly the node the policy's profile names."""
    grants = Grants(policy_root())
    assert {(node, namespace) for namespace, node in grants.profiles} == listed['enclave_nodes']


def test_every_endpoint_is_granted_and_nothing_else(listed):
    endpoints = all_endpoints(listed)
    grants = Grants(policy_root())
    print('endpoints of the node:', *sorted(needed(endpoints)), sep='\n  ')
    assert ungranted(grants, endpoints) == []
    assert unneeded(grants, endpoints) == []
    # the action's hidden services and topics come whole, as sros2 grants an action (execute)
    assert actions_of(endpoints) == {'/gemma_spec/generate': set(ACTION_SERVICES + ACTION_TOPICS)}


def _without(root, tag, text):
    """Return a copy of the policy root without the <tag> whose text is text (its list may be left empty)."""
    root = copy.deepcopy(root)
    for permission in root.iter():
        for expression in list(permission):
            if expression.tag == tag and expression.text == text:
                permission.remove(expression)
    return root


def test_a_missing_grant_is_caught(listed):
    endpoints = all_endpoints(listed)
    root = policy_root()
    assert ungranted(Grants(_without(root, 'service', '~/get_type_description')), endpoints) == [
        ('service', '/gemma_spec/get_type_description')]
    assert ungranted(Grants(_without(root, 'action', '~/generate')), endpoints) == sorted(
        [('service', '/gemma_spec/generate/_action/' + s) for s in ACTION_SERVICES]
        + [('publisher', '/gemma_spec/generate/_action/' + t) for t in ACTION_TOPICS])


def test_a_denied_grant_is_caught(listed):
    root = copy.deepcopy(policy_root())
    denied = ElementTree.SubElement(root.find('enclaves/enclave/profiles/profile'), 'topics', publish='DENY')
    ElementTree.SubElement(denied, 'topic').text = '~/transition_event'
    assert ungranted(Grants(root), all_endpoints(listed)) == [('publisher', '/gemma_spec/transition_event')]


def test_an_extra_grant_is_caught(listed):
    root = copy.deepcopy(policy_root())
    extra = ElementTree.SubElement(root.find('enclaves/enclave/profiles/profile'), 'topics', subscribe='ALLOW')
    ElementTree.SubElement(extra, 'topic').text = 'cmd_vel'
    assert unneeded(Grants(root), all_endpoints(listed)) == [('subscribe', 'rt/cmd_vel')]
